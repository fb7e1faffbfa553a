"""Check and time cocoweave's Triton kernels on one GPU, each against torch and against its memory floor.

    PYTHONPATH=src python3 benchmarks/kernels.py            # on a CUDA machine, one call
    PYTHONPATH=src python3 benchmarks/kernels.py --smoke    # tiny sizes on CPU under TRITON_INTERPRET=1

(a) correctness of every kernel on fresh random inputs against torch / a float64 reference; (b) the
device-to-device copy bandwidth (bytes read + written), measured at the start and the end; (c) median
times. A kernel's memory floor is the bytes it must move over that copy bandwidth; `floor/time` is the
fraction of it reached. Prints a table; writes JSON to $OUT/kernels.json if $OUT is set, else to
benchmarks/results/kernels-<device>-<date>.json. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from baselines import adam_step, adam_step_multi, lamb_step, lamb_step_multi, sgd_step, sgd_step_multi  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from cocoweave import rng  # noqa: E402
from cocoweave.kernels import bias_dropout_residual  # noqa: E402

SMOKE = OPTS.smoke
DEV = torch.device("cpu" if SMOKE else "cuda")
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
LAMB = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
SGD = dict(lr=1e-2, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0)
P_DROP = 0.1
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # relative error of the whole output
RESULTS: dict = {"checks": [], "timings": [], "sweeps": [], "errors": []}
# (timing name prefix, metric, least value) for the H100 goals of issue 7
GOALS = [("adamw", "floor_over_time", 0.95), ("adamw", "speedup", 1.15), ("epilogue", "speedup", 2.0),
         ("lamb", "floor_over_time", 0.85)]


def gpt2_shapes(d: int, layers: int, vocab: int = 50257, ctx: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-2 (embeddings, per-layer LN / attention / MLP, final LN)."""
    attention = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # LN, qkv, output projection
    mlp = [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    layer = attention + mlp
    return [(vocab, d), (ctx, d)] + layer * layers + [(d,), (d,)]


if SMOKE:
    FLAT_SIZES = [10_003]
    MODELS = {"gpt2-tiny": gpt2_shapes(32, 1, vocab=101, ctx=16)}
    EPILOGUE_SHAPE = (16, 96)
    CHECK_N, CHECK_MODEL, COPY_N = 10_003, gpt2_shapes(16, 1, vocab=37, ctx=8), 1 << 16
    CHECK_EPILOGUE = (3, 9, 39), [(0, 0, 3), (0, 1, 2), (1, 4, 3), (2, 13, 13)]  # shape, (dim, offset, size)
    SWEEP = [(1024, 4), (4096, 8)]
    EPILOGUE_SWEEP = [(1024, 4)]
else:
    FLAT_SIZES = [335_000_000, 1_500_000_000]
    MODELS = {"gpt2-medium": gpt2_shapes(1024, 24), "gpt2-xl": gpt2_shapes(1600, 48)}
    EPILOGUE_SHAPE = (16384, 3072)
    CHECK_N, CHECK_MODEL, COPY_N = 1_000_003, gpt2_shapes(96, 2, vocab=1001, ctx=33), 1 << 28
    CHECK_EPILOGUE = (5, 77, 387), [(0, 0, 5), (0, 2, 2), (1, 30, 17), (2, 129, 129)]
    SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
    EPILOGUE_SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]


# ---------------------------------------------------------------------------------------------- helpers


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()  # also surfaces any asynchronous launch error


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call; in smoke mode one call's wall time (only the plumbing is exercised)."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def record_check(name: str, got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    """Relative error ||got - ref|| / ||ref|| in float64, in chunks to bound memory; NaN never passes."""
    diff_sq, ref_sq, finite = 0.0, 0.0, True
    for g, r in zip(got, ref):
        for gc, rc in zip(g.flatten().split(1 << 26), r.flatten().split(1 << 26)):
            gc, rc = gc.double(), rc.double()
            diff_sq += float(((gc - rc) ** 2).sum())
            ref_sq += float((rc**2).sum())
            finite = finite and bool(torch.isfinite(gc).all())
    err = math.sqrt(diff_sq / ref_sq)
    RESULTS["checks"].append({"name": name, "rel_err": err, "tol": tol, "ok": finite and err <= tol})


def record_time(name: str, ms: float, floor_bytes: int | None = None, baseline: str | None = None,
                **extra: object) -> float:
    """A timing, its memory floor from the measured copy bandwidth, and its speedup over a baseline row."""
    row = {"name": name, "ms": ms, **extra}
    if floor_bytes is not None:
        row["bytes"] = floor_bytes
        row["floor_ms"] = floor_bytes / RESULTS["copy_bytes_per_ms"]
        row["floor_over_time"] = row["floor_ms"] / ms
    if baseline is not None:
        base = next(r for r in RESULTS["timings"] if r["name"] == baseline)
        row["speedup_vs"] = {"baseline": baseline, "x": base["ms"] / ms}
    RESULTS["timings"].append(row)
    return ms


def count(n: int) -> str:
    """A parameter count in words: 1.56B, 355M, 10k."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, device=DEV, dtype=dtype)


def state_like(params: list[torch.Tensor], positive: bool = False) -> list[torch.Tensor]:
    """Random optimizer state (v > 0 where `positive`), as after some steps."""
    return [torch.rand_like(p) * 1e-3 if positive else torch.randn_like(p) * 1e-2 for p in params]


def free() -> None:
    sync()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- (b) copy


def measure_copy(tag: str) -> float:
    src = randn(COPY_N)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    bytes_per_ms = 2 * src.numel() * src.element_size() / ms
    RESULTS[f"copy_{tag}"] = {"ms": ms, "bytes": 2 * src.nbytes, "TB_per_s": bytes_per_ms / 1e9}
    return bytes_per_ms


# ---------------------------------------------------------------------------------------------- (a) checks


def step_fn(flat: Callable, multi: Callable, lists: list[list[torch.Tensor]], **kw: object) -> Callable:
    """A call of the flat kernel when the lists hold one tensor each, else of the multi-tensor kernel."""
    if len(lists[0]) == 1:
        return partial(flat, *(ts[0] for ts in lists), **kw)
    return partial(multi, *lists, **kw)


def model(shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], ...]:
    """Random params, grads, first and second moments of the given shapes."""
    params = [randn(*s) for s in shapes]
    return params, [randn(*s) for s in shapes], state_like(params), state_like(params, positive=True)


def clones(*lists: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in ts] for ts in lists]


def torch_params(params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Copies for a torch optimizer to update (sharing the gradients)."""
    tparams = [torch.nn.Parameter(p.clone()) for p in params]
    for tp, g in zip(tparams, grads):
        tp.grad = g
    return tparams


def torch_optimizer(cls: type, tparams: list[torch.nn.Parameter], state: dict[str, list[torch.Tensor]],
                    step: int | None = None, **kw: object) -> torch.optim.Optimizer:
    """A torch optimizer whose state (created by one step, where torch places it) is overwritten by ours."""
    opt = cls(tparams, **kw)
    opt.step()
    for i, tp in enumerate(tparams):
        for key, tensors in state.items():
            opt.state[tp][key].copy_(tensors[i])
        if step is not None:
            opt.state[tp]["step"].fill_(step)
    return opt


def torch_step(cls: type, params: list[torch.Tensor], grads: list[torch.Tensor], state: dict[str, list],
               step: int | None = None, **kw: object) -> list[torch.Tensor]:
    """One step of a torch optimizer on float64 copies, from the given state (step count before the step)."""
    ps = torch_params([p.double() for p in params], [g.double() for g in grads])
    opt = torch_optimizer(cls, ps, state, step, **kw)
    for p, p0 in zip(ps, params):
        p.data.copy_(p0)
    opt.step()
    return [p.detach() for p in ps]


def lamb_reference(w, g, m, v, *, lr, step, beta1, beta2, eps, weight_decay):
    """One LAMB step (You et al. 2020, Algorithm 2) in float64, per tensor."""
    w, g, m, v = (t.double() for t in (w, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps) + weight_decay * w
    w_norm, u_norm = w.norm(), u.norm()
    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
    return w - lr * ratio * u


def check_optimizers() -> None:
    """Fresh random inputs and state, one step, against torch.optim (AdamW, SGD) or the LAMB formula.

    The kernels update in place, so outputs cannot be poisoned; every element moves, so one left
    unwritten shows in the error.
    """
    step = 5
    for kind, shapes in [("flat", [(CHECK_N,)]), ("multi", CHECK_MODEL)]:
        params, grads, m, v = model(shapes)

        ref = torch_step(torch.optim.AdamW, params, grads, {"exp_avg": m, "exp_avg_sq": v}, step - 1,
                         lr=ADAM["lr"], eps=ADAM["eps"], betas=(ADAM["beta1"], ADAM["beta2"]),
                         weight_decay=ADAM["weight_decay"])
        ps, ms, vs = clones(params, m, v)
        step_fn(adam_step, adam_step_multi, [ps, grads, ms, vs], step=step, **ADAM)()
        record_check(f"adamw {kind}", ps, ref, TOL[torch.float32])

        ref = torch_step(torch.optim.SGD, params, grads, {"momentum_buffer": m}, **SGD)
        ps, bufs = clones(params, m)
        step_fn(sgd_step, sgd_step_multi, [ps, grads, bufs], **SGD)()
        record_check(f"sgd momentum {kind}", ps, ref, TOL[torch.float32])

        ref = [lamb_reference(*t, step=step, **LAMB) for t in zip(params, grads, m, v)]
        ps, ms, vs = clones(params, m, v)
        step_fn(lamb_step, lamb_step_multi, [ps, grads, ms, vs], step=step, **LAMB)()
        record_check(f"lamb {kind}", ps, ref, TOL[torch.float32])
    free()


def check_epilogue() -> None:
    """Each dtype on slices along each dim: values against fp32 arithmetic, the mask against the spec."""
    full, slices = CHECK_EPILOGUE
    index = rng.logical_index(full, device=DEV)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, r, b = randn(*full, dtype=dtype), randn(*full, dtype=dtype), randn(full[-1], dtype=dtype)
        ref = rng.dropout(x.float() + b.float(), index, P_DROP, 7, 2) + r.float()
        for dim, offset, size in slices:
            sl = tuple(slice(offset, offset + size) if d == dim else slice(None) for d in range(3))
            where = dict(rank=2, dim=dim, offset=offset, full_size=full[dim])
            out = torch.full_like(x[sl], math.nan).contiguous()  # poisoned: every element must be written
            bias_dropout_residual(x[sl].contiguous(), b[sl[2]].contiguous(), r[sl].contiguous(), P_DROP, 7,
                                  out=out, **where)
            name = f"epilogue {str(dtype)[6:]} dim{dim}@{offset}"
            record_check(name, [out], [ref[sl]], TOL[dtype])
            ones = torch.ones_like(out)  # out = scale where kept, 0 where dropped
            kept = bias_dropout_residual(ones, None, torch.zeros_like(ones), P_DROP, 7, **where) != 0
            same = bool(torch.equal(kept, rng.keep_mask(index[sl], rng.dropout_key(7, 2), rng.keep_threshold(P_DROP))))
            RESULTS["checks"].append({"name": f"{name} mask", "rel_err": float(not same), "tol": 0.0,
                                      "ok": same})
    free()


# ---------------------------------------------------------------------------------------------- (c) timings


def sweep(name: str, make: Callable[..., Callable[[], object]], configs: list[tuple[int, int]],
          floor_bytes: int) -> None:
    """Time `make(block=, num_warps=)` over configurations, to pick the defaults on this device."""
    for block, warps in configs:
        ms = time_ms(make(block=block, num_warps=warps))
        RESULTS["sweeps"].append({"name": name, "block": block, "num_warps": warps, "ms": ms,
                                  "floor_over_time": floor_bytes / RESULTS["copy_bytes_per_ms"] / ms})


def workloads(first_only: bool = False) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(label, parameter shapes): flat tensors, then GPT-2 parameter lists; first_only: one of each."""
    flat = [("flat", [(n,)]) for n in FLAT_SIZES]
    models = list(MODELS.items())
    return [flat[0], models[0]] if first_only else flat + models


def bench_adam() -> None:
    """AdamW against torch fused and foreach; one step from the same state must agree with fused first."""
    for label, shapes in workloads():
        params, grads, ms, vs = model(shapes)
        n = sum(p.numel() for p in params)
        name = f"adamw {label} ({count(n)})"
        make = partial(step_fn, adam_step, adam_step_multi, [params, grads, ms, vs], step=10, **ADAM)
        tparams = torch_params(params, grads)
        for impl in ("fused", "foreach"):
            opt = torch_optimizer(torch.optim.AdamW, tparams, {"exp_avg": ms, "exp_avg_sq": vs}, 9,
                                  lr=ADAM["lr"], eps=ADAM["eps"], weight_decay=ADAM["weight_decay"],
                                  **{impl: True})
            if impl == "fused":
                for tp, p in zip(tparams, params):
                    tp.data.copy_(p)
                opt.step()
                make()()
                record_check(f"{name} vs torch fused", params, [tp.detach() for tp in tparams], 1e-6)
            record_time(f"{name} torch {impl}", time_ms(opt.step), 28 * n)
            del opt
            free()
        del tparams
        free()
        record_time(f"{name} triton", time_ms(make()), 28 * n, baseline=f"{name} torch fused")
        if (label, shapes) in workloads(first_only=True):
            sweep(name, make, SWEEP, 28 * n)
        del params, grads, ms, vs, make
        free()


def bench_sgd_lamb() -> None:
    """SGD with momentum against torch fused; LAMB against its two-pass floor."""
    for label, shapes in workloads(first_only=True):
        params, grads, ms, vs = model(shapes)
        n = sum(p.numel() for p in params)
        name = f"{label} ({count(n)})"
        tparams = torch_params(params, grads)
        opt = torch_optimizer(torch.optim.SGD, tparams, {"momentum_buffer": ms}, fused=True, **SGD)
        record_time(f"sgd momentum {name} torch fused", time_ms(opt.step), 20 * n)
        del opt, tparams
        free()
        sgd = step_fn(sgd_step, sgd_step_multi, [params, grads, ms], **SGD)
        record_time(f"sgd momentum {name} triton", time_ms(sgd), 20 * n,
                    baseline=f"sgd momentum {name} torch fused")
        # two passes: read w, g, m, v and write m, v; read w, m, v and write w
        lamb = step_fn(lamb_step, lamb_step_multi, [params, grads, ms, vs], step=10, **LAMB)
        record_time(f"lamb {name} triton", time_ms(lamb), 40 * n)
        del params, grads, ms, vs, sgd, lamb
        free()


def bench_epilogue() -> None:
    """bf16 bias + dropout + residual against eager PyTorch and torch.compile (their own RNG)."""
    rows, cols = EPILOGUE_SHAPE
    x, r = randn(rows, cols, dtype=torch.bfloat16), randn(rows, cols, dtype=torch.bfloat16)
    b = randn(cols, dtype=torch.bfloat16)
    floor = 3 * x.nbytes + b.nbytes
    name = f"epilogue bf16 [{rows}, {cols}] p={P_DROP}"

    def eager() -> torch.Tensor:
        return torch.nn.functional.dropout(x + b, P_DROP, training=True) + r

    record_time(f"{name} torch eager", time_ms(eager), floor)
    baseline = f"{name} torch eager"
    if not SMOKE:
        try:
            compiled = torch.compile(eager)
            compiled()
            baseline = f"{name} torch.compile"
            record_time(baseline, time_ms(compiled), floor)
        except Exception as e:  # without a working compiler, compare with eager
            RESULTS["errors"].append({"section": "torch.compile", "error": repr(e)})
    make = partial(partial, bias_dropout_residual, x, b, r, P_DROP, 3, out=torch.empty_like(x))
    record_time(f"{name} triton", time_ms(make()), floor, baseline=baseline)
    sweep(name, make, EPILOGUE_SWEEP, floor)
    free()


# ---------------------------------------------------------------------------------------------- report


def environment() -> dict:
    cuda = DEV.type == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": SMOKE,
    }


def print_table() -> None:
    print(f"\n{'check':58} {'rel err':>10} {'tol':>8}")
    for c in RESULTS["checks"]:
        print(f"{c['name']:58} {c['rel_err']:10.2e} {c['tol']:8.0e} {'ok' if c['ok'] else 'FAIL'}")
    print(f"\n{'sweep (block, warps)':58} {'ms':>10} {'floor/time':>10}")
    for s in RESULTS["sweeps"]:
        label = f"{s['name']} ({s['block']}, {s['num_warps']})"
        print(f"{label:58} {s['ms']:10.4f} {s['floor_over_time']:10.3f}")
    start, end = RESULTS["copy_start"]["TB_per_s"], RESULTS["copy_end"]["TB_per_s"]
    print(f"\ncopy bandwidth (read + write): {start:.3f} TB/s at the start, {end:.3f} at the end")
    print(f"{'timing':58} {'ms':>10} {'floor ms':>10} {'floor/time':>10} {'speedup':>8}")
    for t in RESULTS["timings"]:
        speedup = f"{t['speedup_vs']['x']:.2f}x" if "speedup_vs" in t else ""
        floor = f"{t['floor_ms']:10.4f} {t['floor_over_time']:10.3f}"
        print(f"{t['name']:58} {t['ms']:10.4f} {floor} {speedup:>8}")


def evaluate_goals() -> None:
    """Each goal against every triton timing it names."""
    RESULTS["goals"] = []
    for prefix, metric, least in GOALS:
        for t in RESULTS["timings"]:
            if t["name"].startswith(prefix) and t["name"].endswith("triton"):
                value = t["speedup_vs"]["x"] if metric == "speedup" else t[metric]
                RESULTS["goals"].append({"name": t["name"], "metric": metric, "value": value, "least": least,
                                         "met": value >= least})
    title = "goal (smoke: meaningless)" if SMOKE else "goal"
    print(f"\n{title:58} {'metric':>16} {'value':>8} {'least':>6}")
    for g in RESULTS["goals"]:
        verdict = "met" if g["met"] else "MISSED"
        print(f"{g['name']:58} {g['metric']:>16} {g['value']:8.3f} {g['least']:6.2f} {verdict}")


def main() -> int:
    RESULTS["env"] = environment()
    RESULTS["copy_bytes_per_ms"] = measure_copy("start")
    for section in (check_optimizers, check_epilogue, bench_epilogue, bench_adam, bench_sgd_lamb):
        try:
            section()
        except Exception as e:  # one call should report all it can: record, free memory, go on
            traceback.print_exc()
            RESULTS["errors"].append({"section": section.__name__, "error": repr(e)})
            free()
    measure_copy("end")
    print_table()
    evaluate_goals()
    for e in RESULTS["errors"]:
        print(f"ERROR in {e['section']}: {e['error']}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernels.json"
    else:
        device = RESULTS["env"]["device"].split(" (")[0].replace(" ", "-")
        path = Path(__file__).parent / "results" / f"kernels-{device}-{RESULTS['env']['date'][:10]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=1))
    print(f"wrote {path}")
    return 0 if all(c["ok"] for c in RESULTS["checks"]) and not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
