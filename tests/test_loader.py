"""Loading FILE.py:FUNC: every way a program file can be wrong gives one sentence with file and line."""

import pytest

from cocoweave.errors import LoadError, ProgramError
from cocoweave.ir.loader import load_program, parse_sizes

GOOD = """import cocoweave as cw

def prog(N, M=3):
    p = cw.Program("good")
    x = p.tensor("x", (N, M), "float32", cw.Local)
    p.output(cw.all_reduce(x))
    return p

def symbolic():
    p = cw.Program("sym")
    p.output(p.tensor("x", ("K",), "float32") * 2)
    return p
"""


def write(tmp_path, text, name="prog.py"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def test_loads_with_sizes(tmp_path):
    path = write(tmp_path, GOOD)
    p = load_program(f"{path}:prog", {"N": 5})
    assert p.name == "good" and p.inputs["x"].shape == (5, 3)
    assert load_program(f"{path}:symbolic", {"K": 4}).size_names() == ["K"]


@pytest.mark.parametrize("text, spec_func, sizes, pattern", [
    ("def f(:\n", "f", {}, r"prog.py:1: syntax error"),
    (GOOD, "nope", {}, r"prog.py: no function `nope`; it defines: prog, symbolic"),
    (GOOD, "prog", {}, r"`prog` needs size `N`; pass --size N=..."),
    (GOOD, "prog", {"N": 2, "Q": 1}, r"`prog` has no size `Q`; it takes: N, M"),
    ("import cocoweave as cw\n\ndef f():\n    p = cw.Program('x')\n    cw.frobnicate(p)\n", "f", {},
     r"prog.py:5: unknown operation `frobnicate`"),
    ("def f():\n    return 1 / 0\n", "f", {}, r"prog.py:2: ZeroDivisionError: division by zero"),
    ("def f():\n    return 42\n", "f", {}, r"`f` returned int, not a cocoweave Program"),
    ("raise RuntimeError('boom')\n", "f", {}, r"prog.py:1: RuntimeError: boom"),
])
def test_bad_program_files(tmp_path, text, spec_func, sizes, pattern):
    path = write(tmp_path, text)
    with pytest.raises(LoadError, match=pattern):
        load_program(f"{path}:{spec_func}", sizes)


def test_layout_violation_names_the_line(tmp_path):
    text = ("import cocoweave as cw\n\ndef f():\n    p = cw.Program('x')\n"
            "    a = p.tensor('a', (4,), 'float32', cw.Sliced(0))\n"
            "    b = p.tensor('b', (4,), 'float32', cw.Local)\n    return p.output(a + b)\n")
    path = write(tmp_path, text)
    with pytest.raises(ProgramError, match=r"prog.py:7: add\(.*Local operand cannot combine"):
        load_program(f"{path}:f")


def test_missing_file_and_bad_spec(tmp_path):
    with pytest.raises(LoadError, match="no such program file"):
        load_program(f"{tmp_path}/none.py:f")
    with pytest.raises(LoadError, match="must be FILE.py:FUNCTION"):
        load_program("examples/adam.py")


def test_parse_sizes():
    assert parse_sizes(["N=1_024", "B=2,S=3"]) == {"N": 1024, "B": 2, "S": 3}
    with pytest.raises(LoadError, match="must look like NAME=INT"):
        parse_sizes(["N"])
    with pytest.raises(LoadError, match="size N must be an integer"):
        parse_sizes(["N=x"])


def test_import_module_file_loads_once_by_name_and_cleans_up_a_failure(tmp_path):
    import sys

    from cocoweave.ir.loader import import_module_file

    path = write(tmp_path, "VALUE = 41\n", "mod_by_path.py")
    module = import_module_file("cocoweave_test_mod_by_path", path)
    try:
        assert module.VALUE == 41 and import_module_file("cocoweave_test_mod_by_path", path) is module
    finally:
        sys.modules.pop("cocoweave_test_mod_by_path", None)
    bad = write(tmp_path, "raise RuntimeError('boom')\n", "bad_mod.py")
    with pytest.raises(RuntimeError, match="boom"):
        import_module_file("cocoweave_test_bad_mod", bad)
    assert "cocoweave_test_bad_mod" not in sys.modules
    with pytest.raises(ImportError):
        import_module_file("cocoweave_test_no_such_module", None)


def test_a_module_planted_under_the_same_name_on_sys_path_is_never_run(tmp_path, monkeypatch):
    import sys

    from cocoweave.ir.loader import import_module_file

    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / "cocoweave_test_kernel_name.py").write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 0\n")
    monkeypatch.syspath_prepend(str(planted))
    real = write(tmp_path, "VALUE = 7\n", "kernel.py")
    try:
        assert import_module_file("cocoweave_test_kernel_name", real).VALUE == 7
    finally:
        sys.modules.pop("cocoweave_test_kernel_name", None)
    assert not marker.exists()


@pytest.mark.parametrize("text, func, pattern", [
    ("import os\n\ndef f():\n    os._exit(0)\n", "f", r"prog.py:4: the program called os._exit\(0\); a program file "
                                                    r"must return a Program, not end the process"),
    ("from os import _exit\n_exit(3)\n", "f", r"prog.py:2: the program called os._exit\(3\)"),
    ("def f():\n    while True:\n        pass\n", "f", r"prog.py:[23]: still running after [0-9.]+ s of loading"),
    ("import time\ntry:\n    time.sleep(60)\nexcept Exception:\n    pass\n", "f", r"prog.py:3: still running after"),
])
def test_a_program_that_ends_the_process_or_never_returns_is_stopped(tmp_path, text, func, pattern, time_scale):
    import os
    import time

    path = write(tmp_path, text)
    t0 = time.monotonic()
    with pytest.raises(LoadError, match=pattern):
        load_program(f"{path}:{func}", timeout_s=0.5 * time_scale)
    assert time.monotonic() - t0 < 5 * time_scale
    assert os._exit.__module__ in ("posix", "nt")  # the real os._exit is back
    good = write(tmp_path, GOOD, "good.py")
    assert load_program(f"{good}:prog", {"N": 2}, timeout_s=0.5 * time_scale).name == "good"
