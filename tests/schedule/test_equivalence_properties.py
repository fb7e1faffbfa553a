"""Equivalence is the law: random well-typed programs x random legal transformation sequences x
world sizes 1..8 x sizes that do not divide, all equal to the unscheduled program (reference backend)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocoweave as cw
from cocoweave.equivalence.check import check_schedules
from cocoweave.errors import ScheduleError
from cocoweave.schedule.schedule import Schedule

UNARY = ["sqrt_abs", "exp_neg", "neg", "scale", "cast64", "dropout"]
BINARY = ["add", "sub", "mul", "maximum", "div_safe", "where"]
REDUCE = ["sum", "norm", "max"]


@st.composite
def programs(draw):
    n, m, k = draw(st.integers(1, 13)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    shape = draw(st.sampled_from([(n,), (n, m)]))
    p = cw.Program("random")
    a, b = p.scalars("a b")
    if len(shape) == 2 and draw(st.booleans()):  # a row-parallel matmul makes the Local partial sums
        x = p.tensor("x", (n, k), "float32", cw.Sliced(1))
        w = p.tensor("w", (k, m), "float32", cw.Sliced(0))
        local = cw.matmul(x, w)
    else:
        local = p.tensor("g", shape, "float32", cw.Local)
    states = [p.tensor(f"s{i}", shape, "float32", cw.Replicated, init="positive")
              for i in range(draw(st.integers(0, 3)))]
    extras = [p.tensor("r", shape, "float32"), p.tensor("bias", shape[-1:], "float32")]
    pool = [cw.all_reduce(local, draw(st.sampled_from(["sum", "avg", "max", "min"])))]
    pool += states + extras
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(UNARY + BINARY + REDUCE))
        x = draw(st.sampled_from(pool))
        y = draw(st.sampled_from(pool))
        pool.append(_apply(kind, x, y, a, b, draw(st.integers(0, 3))))
    full = [v for v in pool if v.shape == shape and v.op != "input"]
    for s in states:
        if full and draw(st.booleans()):
            p.update(s, cw.abs(draw(st.sampled_from(full))) + s * a)
    p.output(pool[-1], "out")
    if draw(st.booleans()):
        p.output(draw(st.sampled_from(pool)), "extra")
    return p


def _apply(kind, x, y, a, b, seed):
    if kind == "sqrt_abs":
        return cw.sqrt(cw.abs(x))
    if kind == "exp_neg":
        return cw.exp(-cw.abs(x))
    if kind == "neg":
        return -x
    if kind == "scale":
        return x * a + b
    if kind == "cast64":
        return cw.cast(cw.cast(x, "float64") * 2.0, "float32")
    if kind == "dropout":
        return cw.dropout(x, 0.3, seed=seed)
    if kind == "add":
        return x + y
    if kind == "sub":
        return x - y
    if kind == "mul":
        return x * y
    if kind == "maximum":
        return cw.maximum(x, y)
    if kind == "div_safe":
        return x / (cw.abs(y) + 1.0)
    if kind == "where":
        return cw.where(x > y, x, y * a)
    if kind == "sum":
        return cw.sum(x) if x.ndim < 2 or seed % 2 else cw.sum(x, dim=0)
    if kind == "norm":
        return cw.norm(x)
    return cw.max(x)


@st.composite
def schedules(draw, program):
    """A random sequence of transformation requests; refused ones (ScheduleError) are skipped, so
    every step that stays in the schedule was legal."""
    s = Schedule(program)
    if draw(st.booleans()):  # often start from CoCoNet's recipe so that later steps have more to act on
        for ar in s.find("all_reduce"):
            try:
                s.reorder(s.split(ar, dim=draw(st.integers(0, 1)))[1])
            except ScheduleError:
                pass
        for name in sorted(program.updates):
            if draw(st.booleans()):
                try:
                    s.as_slice(name)
                except ScheduleError:
                    pass
    for _ in range(draw(st.integers(0, 7))):
        step = draw(st.sampled_from(["split", "reorder", "as_slice", "fuse", "overlap"]))
        stages = s.stages
        try:
            if step == "split" and s.find("all_reduce"):
                ar = draw(st.sampled_from(s.find("all_reduce")))
                s.split(ar, dim=draw(st.integers(0, 1)))
            elif step == "reorder" and s.find("all_gather"):
                s.reorder(draw(st.sampled_from(s.find("all_gather"))))
            elif step == "as_slice" and program.updates:
                s.as_slice(draw(st.sampled_from(sorted(program.updates))))
            elif step in ("fuse", "overlap") and stages:
                i = draw(st.integers(0, len(stages) - 1))
                j = draw(st.integers(i, min(len(stages), i + 3) - 1))
                if step == "fuse":
                    s.fuse(*stages[i:j + 1])
                else:
                    s.overlap(*stages[i:j + 1], chunks=draw(st.sampled_from([2, 3, 4, 8])))
        except ScheduleError:
            pass
    return s


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_schedules_of_random_programs_are_equivalent(data):
    program = data.draw(programs())
    schedule = data.draw(schedules(program))
    world = data.draw(st.integers(1, 8))
    (row,) = check_schedules(program, [schedule], world, seed=data.draw(st.integers(0, 100)))
    assert row.ok, f"{schedule}\nworld {world}: {row}"


@st.composite
def workloads(draw):
    """Random instances of the paper's families: matmul -> all_reduce -> epilogue, and
    all_reduce -> epilogue -> send to the next pipeline stage."""
    b, s, h = draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 12))
    p = cw.Program("family")
    pipeline = draw(st.booleans())
    if pipeline:
        this, nxt = p.pipeline(2)
        y = cw.all_reduce(p.tensor("x", (b, s, h), "float32", cw.Local, group=this))
    else:
        this = nxt = None
        x = p.tensor("x", (b, s, h), "float32", cw.Sliced(2))
        w = p.tensor("w", (h, h), "float32", cw.Sliced(0))
        y = cw.all_reduce(cw.matmul(x, w))
    bias = p.tensor("bias", (h,), "float32", group=this)
    res = p.tensor("res", (b, s, h), "float32", group=this)
    for kind in draw(st.lists(st.sampled_from(["bias", "dropout", "residual", "scale"]), min_size=1, max_size=4)):
        if kind == "bias":
            y = y + bias
        elif kind == "dropout":
            y = cw.dropout(y, 0.2, seed=3)
        elif kind == "residual":
            y = y + res
        else:
            y = y * 0.5
    p.output(cw.send(y, nxt) if pipeline else y, "out")
    return p


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_enumerated_schedules_of_random_workloads_are_equivalent(data):
    from cocoweave.schedule.enumerate import enumerate_schedules

    program = data.draw(workloads())
    schedules = enumerate_schedules(program)
    picked = data.draw(st.lists(st.sampled_from(schedules), min_size=1, max_size=6, unique_by=lambda s: s.name))
    world = data.draw(st.sampled_from([2, 4, 6, 8] if len(program.groups) > 1 else range(1, 9)))
    for row in check_schedules(program, picked, world, seed=data.draw(st.integers(0, 100))):
        assert row.ok, f"{program}\nworld {world}: {row}"
