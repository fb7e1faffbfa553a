"""How well this host shares its cores among more ranks than cores when the ranks meet every step: measured.

p processes (spawned, no torch) each burn `busy_ms` of CPU per step, times a factor drawn at random per rank and
step from `spread` (the measured steps of one rank over their median: real ranks do not do equal work every step),
then pass a token around a ring `hops` times (a ring collective's message steps: each needs its neighbour on a core,
which on shared cores waits for a time slice), and meet at a barrier. Each rank notes when it runs again after the
barrier, and a step is timed as the profiler times a world's: the slowest rank's median time between its own two
such moments (a rank left waiting for a core while the others resume makes its steps longer). Ideal processor
sharing would take p x busy / K per step on K cores; the measured factor (>= 1) is what the host's scheduler adds: a
core left idle while the last rank of a step finishes, ranks unevenly spread over the cores' run queues, time
slices.
`cocoweave profile` uses it for core sharing at a predicted size when no fitted world oversubscribed the cores.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import statistics
import time
from collections.abc import Sequence
from threading import BrokenBarrierError

from cocoweave.errors import CocoweaveError

STEPS = 40  # a step varies by 10% and more on shared cores: the median of 12 moved the factor by up to 0.1
WARMUP = 2
WINDOW = 5  # steps around a step whose median it is compared with (step_spread)


class CoreSharingError(CocoweaveError):
    """The core-sharing measurement could not run (a process failed or a barrier timed out)."""


def _burn(barrier, busy_s: float, spread: list[float], seed: int, steps: int,  # noqa: ANN001 (a mp Barrier)
          timeout_s: float, hops: int, send, recv, out) -> None:  # noqa: ANN001 (pipe ends, a result queue)
    """One synthetic rank: `steps` times, meet the others, spend `busy_s` x a factor from `spread` of CPU, then
    send to the next rank and receive from the previous one `hops` times; puts when it resumed after each meeting."""
    draw = random.Random(seed)
    resumed = []
    for _ in range(steps):
        barrier.wait(timeout_s)
        resumed.append(time.perf_counter())
        start, burn = time.thread_time(), busy_s * draw.choice(spread)
        while time.thread_time() - start < burn:
            pass
        for _ in range(hops):
            send.send_bytes(b"x")
            if not recv.poll(timeout_s):
                raise TimeoutError("no token from the previous rank")
            recv.recv_bytes()
    barrier.wait(timeout_s)
    resumed.append(time.perf_counter())
    out.put((seed, resumed))


def step_spread(steps_ms: Sequence[float], window: int = WINDOW) -> list[float]:
    """Each measured step over the median of the `window` steps around it: how unequal a rank's steps are from one
    step to the next, without the slow spells of a shared machine (a round measured while the host was slower
    shifts a run of steps, and independent draws from it would make every synthetic step meet a slow rank)."""
    half = window // 2
    out = []
    for i, step in enumerate(steps_ms):
        around = statistics.median(steps_ms[max(i - half, 0):i + half + 1])
        if around > 0:
            out.append(step / around)
    return out or [1.0]


def sharing_factor(ranks: int, cores: int, busy_ms: float, spread: Sequence[float] = (1.0,), hops: int = 0,
                   steps: int = STEPS, timeout_s: float = 60.0) -> float:
    """Measured step of `ranks` synchronised processes of `busy_ms` CPU each (times a factor from `spread`) on
    `cores` cores, over the ideal ranks x busy / cores (median over `steps` steps after warm-up; at least 1)."""
    if ranks < 1 or cores < 1 or busy_ms <= 0:
        raise CoreSharingError(f"core sharing needs ranks, cores and a busy time above 0, got {ranks}, {cores} and "
                               f"{busy_ms:g} ms.")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(ranks + 1)
    total = steps + WARMUP
    factors = [float(f) for f in spread if f > 0] or [1.0]
    pipes = [ctx.Pipe(duplex=False) for _ in range(ranks)]  # pipes[r]: rank r-1 -> rank r
    out = ctx.Queue()
    procs = [ctx.Process(target=_burn, args=(barrier, busy_ms / 1e3, factors, r, total, timeout_s, hops,
                                             pipes[(r + 1) % ranks][1], pipes[r][0], out), daemon=True)
             for r in range(ranks)]
    for proc in procs:
        proc.start()
    try:
        barrier.wait(timeout_s)
        for _ in range(total):
            barrier.wait(timeout_s)
        resumed = [out.get(timeout=timeout_s)[1] for _ in range(ranks)]
    except (BrokenBarrierError, queue.Empty):
        raise CoreSharingError(f"the core-sharing measurement ({ranks} processes of {busy_ms:.0f} ms) did not meet "
                               f"within {timeout_s:g} s.") from None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    step_s = max(statistics.median([r[t + 1] - r[t] for t in range(WARMUP, total)]) for r in resumed)
    ideal_s = max(ranks / cores, 1.0) * busy_ms / 1e3
    return max(step_s / ideal_s, 1.0)
