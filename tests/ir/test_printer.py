"""The printer shows one line per operation with layouts and shapes; fingerprints are stable."""

import cocoweave as cw


def build(N=8, name="w"):
    p = cw.Program("adamish")
    g = p.tensor("g", (N,), "float32", cw.Local)
    w = p.tensor(name, (N,), "float32", cw.Replicated)
    lr = p.scalar("lr")
    p.update(w, w - lr * cw.all_reduce(g, "avg"))
    return p


def test_printer_shows_every_operation_with_types():
    text = str(build())
    assert text.splitlines()[0] == "program adamish"
    assert "input  g: float32[8] Local" in text
    assert "scalar lr: float32" in text
    assert "all_reduce(g, op=avg)  : float32[8] Replicated" in text
    assert "w' = update(w, " in text
    assert len(text.splitlines()) == 1 + 3 + 4  # header, inputs, four operations


def test_fingerprint_is_stable_and_sensitive():
    assert build().fingerprint() == build().fingerprint()
    assert build().fingerprint() != build(N=9).fingerprint()
    assert build().fingerprint() != build(name="v").fingerprint()
    assert len(build().fingerprint()) == 16


def test_pipeline_program_prints_groups():
    p = cw.Program("pp")
    s0, s1 = p.pipeline(2)
    x = p.tensor("x", (4,), "float32", cw.Local, group=s0)
    p.output(cw.send(cw.all_reduce(x), s1), "h")
    text = str(p)
    assert "groups: stage0, stage1" in text
    assert "send(%1, to='stage1')  : float32[4] Replicated @stage1" in text
    assert "output h = %2" in text
