"""Generated Triton kernels of fused stages against the hand-written kernels and the torch ops path, on one GPU.

    PYTHONPATH=src python3 benchmarks/codegen.py            # on a CUDA machine
    PYTHONPATH=src python3 benchmarks/codegen.py --smoke    # tiny sizes on CPU under TRITON_INTERPRET=1

Two one-stage programs run as a torch-backend Executable on one rank: an Adam step (fp32, the example's
formula, the gradient already averaged) and the bf16 bias + dropout + residual epilogue. Each is timed
(median, triton.testing.do_bench) as a whole step with kernels="triton" (the generated kernel) and
kernels="torch" (one torch op per operation), next to the hand-written kernel (kernels/adam.py,
kernels/epilogue.py) and the memory floor (bytes that must move over the measured copy bandwidth). A whole
step includes the executable's host work; the row "step overhead" measures it on a tiny tensor. Results
are checked first (generated against torch ops and against the hand-written kernel). Prints a table;
writes JSON to $OUT/codegen.json if $OUT is set, else to benchmarks/results/codegen-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
OPTS = ARGS.parse_args()
if OPTS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from baselines import adam_step  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import cocoweave as cw  # noqa: E402
from cocoweave.backends.torch.executable import Executable  # noqa: E402
from cocoweave.equivalence.compare import compare  # noqa: E402
from cocoweave.kernels import bias_dropout_residual  # noqa: E402
from cocoweave.plan import lower  # noqa: E402
from cocoweave.schedule.schedule import Schedule  # noqa: E402

DEV = torch.device("cpu" if OPTS.smoke else "cuda")
N = 10_003 if OPTS.smoke else 335_000_000
EPILOGUE = (16, 96) if OPTS.smoke else (16384, 3072)
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 3.0}


def adam_program(n: int) -> cw.Program:
    """The Adam example's update (workloads.adam) on an already averaged gradient: one fused stage."""
    p = cw.Program("adam_step")
    g, w, m = (p.tensor(x, (n,), "float32") for x in "gwm")
    v = p.tensor("v", (n,), "float32", init="positive")
    lr, b1, b2, eps, step = p.scalars("lr beta1 beta2 eps step")
    m1 = p.update(m, b1 * m + (1 - b1) * g)
    v1 = p.update(v, b2 * v + (1 - b2) * g * g)
    p.update(w, w - lr * (m1 / (1 - b1**step)) / (cw.sqrt(v1 / (1 - b2**step)) + eps))
    return p


def epilogue_program(rows: int, cols: int) -> cw.Program:
    p = cw.Program("epilogue")
    y, r = (p.tensor(x, (rows, cols), "bfloat16") for x in "yr")
    p.output(cw.dropout(y + p.tensor("b", (cols,), "bfloat16"), 0.1, seed=0) + r, "out")
    return p


def executable(program: cw.Program, kernels: str) -> Executable:
    s = Schedule(program)
    s.fuse(s.stages[0])
    return Executable(lower(s), 0, 1, {}, DEV, kernels=kernels)


def inputs_of(program: cw.Program) -> dict:
    """The same random inputs on every call, made on the device."""
    torch.manual_seed(0)
    out: dict = dict(HYPER) if program.name == "adam_step" else {}
    for v in program.tensor_inputs:
        shape = tuple(v.shape)
        t = torch.rand(shape, device=DEV) + 0.1 if v.attrs["init"] == "positive" else torch.randn(shape, device=DEV)
        out[v.name] = t.to(getattr(torch, v.dtype))
    return out


def time_ms(fn: Callable[[], object]) -> float:
    if OPTS.smoke:  # one call's wall time: only the plumbing is exercised
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bytes_per_ms() -> float:
    src = torch.randn(1 << 16 if OPTS.smoke else 1 << 28, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / time_ms(lambda: dst.copy_(src))


class Table:
    """Timings with their memory floor (over the measured copy bandwidth) and ratios to torch ops; checks."""

    def __init__(self) -> None:
        self.bandwidth = copy_bytes_per_ms()
        self.rows: list[dict] = []
        self.checks: list[dict] = []

    def row(self, case: str, name: str, ms: float, floor_bytes: int, base: float | None = None) -> None:
        floor = floor_bytes / self.bandwidth
        self.rows.append({"case": case, "name": name, "ms": ms, "floor_ms": floor, "floor_over_time": floor / ms,
                          "torch_ops_over_this": None if base is None else base / ms})

    def check(self, name: str, ok: bool) -> None:
        self.checks.append({"name": name, "ok": ok})


def bench_adam(t: Table) -> None:
    """4 reads and 3 writes of fp32 per parameter."""
    adam = adam_program(N)
    gen_exe, torch_exe = executable(adam, "triton"), executable(adam, "torch")
    got, want = inputs_of(adam), inputs_of(adam)
    gen_exe.run(got)
    torch_exe.run(want)
    hand = inputs_of(adam)
    adam_step(hand["w"], hand["g"], hand["m"], hand["v"], lr=HYPER["lr"], step=int(HYPER["step"]),
              beta1=HYPER["beta1"], beta2=HYPER["beta2"], eps=HYPER["eps"])
    for n in "wmv":
        t.check(f"adam {n}: generated vs torch ops", compare(got[n], want[n]).ok)
        t.check(f"adam {n}: generated vs kernels/adam.py", compare(got[n], hand[n]).ok)
    base = time_ms(lambda: torch_exe.run(want))
    t.row("adam fp32", "torch ops", base, 28 * N)
    t.row("adam fp32", "generated", time_ms(lambda: gen_exe.run(got)), 28 * N, base)
    t.row("adam fp32", "kernels/adam.py", time_ms(lambda: adam_step(
        hand["w"], hand["g"], hand["m"], hand["v"], lr=1e-3, step=3)), 28 * N, base)
    small = adam_program(1024)
    small_exe, small_in = executable(small, "triton"), inputs_of(small)
    t.row("adam fp32", "step overhead (N=1024)", time_ms(lambda: small_exe.run(small_in)), 28 * 1024)


def bench_epilogue(t: Table) -> None:
    """Read y and r, write out (bf16); the bias stays in cache."""
    epi = epilogue_program(*EPILOGUE)
    gen_exe, torch_exe = executable(epi, "triton"), executable(epi, "torch")
    x = inputs_of(epi)
    out_gen, out_torch = gen_exe.run(x).outputs["out"], torch_exe.run(x).outputs["out"]
    hand_out = bias_dropout_residual(x["y"], x["b"], x["r"], 0.1, seed=0)
    t.check("epilogue: generated vs torch ops", compare(out_gen, out_torch).ok)
    t.check("epilogue: generated vs kernels/epilogue.py", compare(out_gen, hand_out).ok)
    elems = EPILOGUE[0] * EPILOGUE[1]
    base = time_ms(lambda: torch_exe.run(x))
    t.row("epilogue bf16", "torch ops", base, 6 * elems)
    t.row("epilogue bf16", "generated", time_ms(lambda: gen_exe.run(x)), 6 * elems, base)
    t.row("epilogue bf16", "kernels/epilogue.py", time_ms(
        lambda: bias_dropout_residual(x["y"], x["b"], x["r"], 0.1, seed=0, out=hand_out)), 6 * elems, base)


def main() -> int:
    t = Table()
    bench_adam(t)
    bench_epilogue(t)
    rows, checks = t.rows, t.checks
    print(f"{'case':<15}{'kernel':<24}{'ms':>10}{'floor/time':>12}{'torch ops/this':>16}")
    for r in rows:
        ratio = "" if r["torch_ops_over_this"] is None else f"{r['torch_ops_over_this']:.2f}x"
        print(f"{r['case']:<15}{r['name']:<24}{r['ms']:>10.3f}{r['floor_over_time']:>12.2f}{ratio:>16}")
    for c in checks:
        print(("ok    " if c["ok"] else "FAIL  ") + c["name"])
    device = "cpu-interpreter" if OPTS.smoke else torch.cuda.get_device_name().replace(" ", "-")
    result = {"device": device, "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "python": platform.python_version()},
              "copy_TB_per_s": t.bandwidth / 1e9, "timings": rows, "checks": checks, "smoke": OPTS.smoke}
    out = Path(os.environ["OUT"]) / "codegen.json" if os.environ.get("OUT") else \
        Path(__file__).parent / "results" / f"codegen-{device}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
