"""The process runtime: live local worlds, failures as BackendErrors within the timeout, torchrun init,
and the trace recorder. Rank functions are module-level so that ranks can import them."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from cocoweave import faults, launch
from cocoweave.errors import BackendError
from cocoweave.launch import (
    LocalWorld,
    in_torchrun,
    init_from_env,
    rank_device,
    rank_state,
    spawn_and_run,
)
from cocoweave.launch import torchrun as launch_torchrun
from cocoweave.launch import worker as launch_worker
from cocoweave.launch.failures import _first_line, _is_comm_failure
from cocoweave.perf.trace import Tracer, merge_and_write

# -- rank functions ----------------------------------------------------------------------------------------


def _all_reduce(rank: int, world_size: int) -> torch.Tensor:
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t


def _echo(rank: int, world_size: int, x: torch.Tensor,
          *, scale: float = 1.0) -> tuple[int, int, torch.Tensor]:
    return rank, world_size, x * scale + rank


def _count_calls(rank: int, world_size: int) -> int:
    state = rank_state()
    state["calls"] = state.get("calls", 0) + 1
    return state["calls"]


def _settings(rank: int, world_size: int) -> tuple[int, str, bool]:
    return torch.get_num_threads(), str(rank_device()), in_torchrun()


def _raise_on_2(rank: int, world_size: int) -> int:
    if rank == 2:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def _raise_then_collective(rank: int, world_size: int) -> torch.Tensor:
    if rank == 1:
        raise KeyError("missing")
    return _all_reduce(rank, world_size)


def _exit_on_1(rank: int, world_size: int) -> torch.Tensor:
    if rank == 1:
        os._exit(3)
    return _all_reduce(rank, world_size)


def _exit_0_on_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(0)  # a clean exit code, but no result: still a failed rank
    return rank


def _sleep_on_1(rank: int, world_size: int, seconds: float) -> int:
    if rank == 1:
        time.sleep(seconds)
    return rank


def _traced(rank: int, world_size: int) -> list[dict]:
    tracer = Tracer(rank)
    for chunk in range(2):
        with tracer.span("matmul", chunk=chunk):
            torch.ones(16, 16) @ torch.ones(16, 16)
        with tracer.span("all_reduce", stream="comm", chunk=chunk):
            _all_reduce(rank, world_size)
    return tracer.events()


def _sleep_then_all_reduce(rank: int, world_size: int, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return _all_reduce(rank, world_size)


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def listening_addresses(pids: list[int] | None = None, port: int | None = None) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of the TCP sockets listening on `port` or owned by
    `pids` (Linux)."""
    inodes = set()
    for pid in pids or []:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and (fields[9] in inodes or int(hexport, 16) == port):
                found.append(address)
    return found


LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


# -- shared worlds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_sums_over_ranks(local_world, n):
    results = local_world(n).run(_all_reduce)
    assert len(results) == n
    for t in results:
        assert torch.equal(t, torch.full((3,), n * (n + 1) / 2))


def test_run_passes_args_kwargs_and_tensors(world4):
    x = torch.arange(5.0)
    results = world4.run(_echo, x, scale=2.0)
    assert [r[:2] for r in results] == [(r, 4) for r in range(4)]
    for rank, (_, _, y) in enumerate(results):
        assert torch.equal(y, x * 2 + rank)


def test_ranks_use_their_thread_share_and_cpu(world4):
    threads = max(1, len(os.sched_getaffinity(0)) // 4)
    assert world4.threads_per_rank == threads
    assert world4.run(_settings) == [(threads, "cpu", False)] * 4


def test_partial_functions_carry_their_arguments(world4):
    results = world4.run(functools.partial(_echo, scale=0.0), torch.zeros(1))
    assert [float(r[2]) for r in results] == [0.0, 1.0, 2.0, 3.0]


def test_ranks_stay_alive_between_runs(world4):
    first = world4.run(_count_calls)
    second = world4.run(_count_calls)
    assert [b - a for a, b in zip(first, second)] == [1, 1, 1, 1]


def test_rank_that_raises_is_named_and_world_survives(world4):
    with pytest.raises(BackendError, match=r"^rank 2 failed: ValueError: bad input on rank 2$") as info:
        world4.run(_raise_on_2)
    assert info.value.ranks == [2]
    assert "Traceback" in info.value.remote_traceback and "_raise_on_2" in info.value.remote_traceback
    assert isinstance(info.value.remote_exception, ValueError)
    assert world4.broken is None
    assert torch.equal(world4.run(_all_reduce)[0], torch.full((3,), 10.0))


def test_lambdas_nested_and_notebook_functions_run_on_the_ranks_with_their_closures(world4, monkeypatch):
    offset = 10

    def nested(rank: int, world_size: int) -> int:  # as a notebook or a test would write it
        return rank * world_size + offset

    assert world4.run(lambda rank, world_size: (rank, world_size)) == [(r, 4) for r in range(4)]
    assert world4.run(nested) == [10, 14, 18, 22]
    notebook = types.ModuleType("__main__")  # a notebook's __main__: no file the ranks could import
    exec("def cell(rank, world_size):\n    return rank * 100\n", notebook.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    assert world4.run(notebook.cell) == [0, 100, 200, 300]
    lock = threading.Lock()
    with pytest.raises(BackendError, match=r"^`.*<lambda>` cannot be sent to ranks: TypeError: .*lock"):
        world4.run(lambda rank, world_size: lock.locked())  # its closure holds what cannot be pickled
    assert world4.broken is None


def _unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_result_is_an_error_naming_the_ranks(world4):
    with pytest.raises(BackendError, match=r"^ranks 0, 1, 2, 3 failed: its result cannot be pickled: "):
        world4.run(_unpicklable_result)
    assert world4.broken is None


def test_trace_of_a_world_has_one_track_per_rank_and_stream(world4, tmp_path):
    per_rank = world4.run(_traced)
    path = tmp_path / "trace.json"
    merge_and_write(per_rank, path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert len(spans) == 4 * 4 and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    threads = {(e["pid"], e["tid"], e["args"]["name"])
               for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert len(threads) == 8 and {t[2] for t in threads} == {"compute", "comm"}
    assert {e["args"]["chunk"] for e in spans} == {0, 1}


# -- worlds that tests break -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fragile(whole_time_scale):
    """A world of 2 ranks with a 3 s timeout (times the machine's slowness, conftest.whole_time_scale) that tests may
    break (each test restarts it if needed). `fragile.scale` is that factor: the tests' time bounds use it."""
    scale = whole_time_scale
    world = LocalWorld(2, timeout_s=3 * scale)
    world.scale = scale
    world.run(_pid)  # the ranks import this module now, not inside a timed call
    yield world
    world.close()


def _ensure_live(world: LocalWorld) -> None:
    if world.broken:
        world.restart()
        world.run(_pid)


def test_a_sleep_within_the_timeout_is_fine(fragile):
    _ensure_live(fragile)
    assert fragile.call(_sleep_on_1, (0.2,), timeout_s=2.0 * fragile.scale) == [0, 1]


def test_dead_rank_is_named_quickly_and_restart_works(fragile):
    _ensure_live(fragile)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"^rank 1 exited with code 3 during run of `_exit_on_1`$") as info:
        fragile.run(_exit_on_1)
    assert time.monotonic() - t0 < 2.0 * fragile.scale
    assert info.value.ranks == [1] and info.value.exit_codes == {1: 3}
    assert fragile.broken
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="unusable because rank 1 exited with code 3; call restart"):
        fragile.run(_all_reduce)
    assert time.monotonic() - t0 < 0.1 * fragile.scale
    fragile.restart()
    assert fragile.broken is None
    assert [t.tolist() for t in fragile.run(_all_reduce)] == [[3.0] * 3] * 2


def test_a_rank_that_exits_0_without_a_result_is_a_failure(fragile):
    _ensure_live(fragile)
    with pytest.raises(BackendError, match=r"^rank 1 exited with code 0 without returning a result during run of "
                                           r"`_exit_0_on_1`$") as info:
        fragile.run(_exit_0_on_1)
    assert info.value.ranks == [1] and fragile.broken


def test_hung_rank_is_named_within_the_timeout(fragile):
    _ensure_live(fragile)
    t0 = time.monotonic()
    timeout = fragile.timeout_s
    with pytest.raises(BackendError, match=rf"^rank 1 did not finish `_sleep_on_1` within {timeout:g} s$"):
        fragile.run(_sleep_on_1, 20.0 * timeout)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed < timeout + 1.5 * fragile.scale
    assert fragile.broken
    with pytest.raises(BackendError, match="unusable"):
        fragile.run(_all_reduce)


def test_raise_before_a_collective_tears_down_the_stuck_ranks(fragile):
    _ensure_live(fragile)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"^rank 1 failed: KeyError: 'missing'; rank 0 did not finish"):
        fragile.run(_raise_then_collective)
    assert time.monotonic() - t0 < fragile.timeout_s
    assert fragile.broken


def test_a_run_longer_than_the_timeout_is_fine_when_no_rank_waits_that_long(fragile):
    _ensure_live(fragile)  # timeout 3 s: each rank waits at most that long for the others
    results = fragile.run(_sleep_then_all_reduce, 4.0 / 3.0 * fragile.timeout_s)
    assert [t.tolist() for t in results] == [[3.0] * 3] * 2


def test_the_wall_timeout_caps_a_whole_call(fragile):
    _ensure_live(fragile)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"^ranks 0, 1 did not finish `_sleep_then_all_reduce` within the wall "
                                           r"timeout of 1 s$"):
        fragile.call(_sleep_then_all_reduce, (30.0,), wall_timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 4.0 * fragile.scale and fragile.broken  # 1 s, then the teardown


def test_a_stopped_rank_is_named_as_the_one_that_stopped_answering(fragile):
    _ensure_live(fragile)
    os.kill(fragile.pids[1], signal.SIGSTOP)  # stopped while idle: it never starts the next call
    t0 = time.monotonic()
    with pytest.raises(BackendError) as info:
        fragile.run(_all_reduce)
    msg = str(info.value)
    assert msg.startswith("rank 1 stopped answering and did not finish the run of `_all_reduce` (rank 1 is "
                          "stopped by a signal); rank 0 gave up waiting: "), msg
    assert "stage" not in msg and "Timed out" in msg  # rank 1 never entered a stage of this call
    assert info.value.ranks == [1, 0] and fragile.broken
    # Gloo's 3 s wait, the error grace, teardown (loaded CPUs)
    assert time.monotonic() - t0 < fragile.timeout_s + (2.0 + 5.0) * fragile.scale


def test_communication_failures_break_the_world():
    # Messages Gloo gave after a peer died and after a collective timed out (the pair is closed for good).
    for message in ["[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. GLHF",
                    "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv",
                    "Application timeout caused pair closure"]:
        assert _is_comm_failure(RuntimeError(message))
    assert not _is_comm_failure(RuntimeError("shape mismatch"))
    assert _first_line(RuntimeError("[/x/pair.cc:553] Connection closed by peer")) == \
        "Connection closed by peer"


def test_spawn_and_run_one_shot():
    results = spawn_and_run(1, _echo, (torch.ones(2),), {"scale": 3.0})
    assert results[0][0] == 0 and torch.equal(results[0][2], torch.full((2,), 3.0))


def test_closed_world_refuses_work_and_can_restart():
    with LocalWorld(1) as world:
        assert world.run(_echo, torch.zeros(1))[0][0] == 0
    with pytest.raises(BackendError, match="unusable because it was closed"):
        world.run(_all_reduce)
    world.restart()
    assert world.run(_all_reduce)[0].tolist() == [1.0] * 3
    world.close()


def test_bad_arguments_are_rejected():
    with pytest.raises(BackendError, match="at least one rank"):
        LocalWorld(0)
    with pytest.raises(BackendError, match=r"a local world of 10000 ranks is more than this machine should start "
                                           r"\(at most \d+: 4 per core, at least 16; set COCOWEAVE_MAX_LOCAL_RANKS"):
        LocalWorld(10000)
    for bad in (float("inf"), float("nan"), 0, -1, 1e9):
        with pytest.raises(BackendError, match="timeout_s must be a finite number of seconds above 0"):
            LocalWorld(2, timeout_s=bad)
    with pytest.raises(BackendError, match="wall_timeout_s must be a finite number"):
        LocalWorld(2, wall_timeout_s=float("inf"))
    with pytest.raises(BackendError, match="backend must be"):
        LocalWorld(2, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="no GPU"):
            LocalWorld(2, device="cuda")


def test_every_listening_socket_of_a_world_is_on_loopback():
    with LocalWorld(2) as world:
        parent = listening_addresses(port=world._store.port)
        ranks = listening_addresses(world.pids)
    assert parent and all(a in LOOPBACK for a in parent), parent  # the rendezvous store
    assert ranks and all(a in LOOPBACK for a in ranks), ranks  # Gloo's pairs


def test_a_failure_to_start_a_rank_stops_the_ones_already_started(monkeypatch, time_scale):
    import multiprocessing.context as mp_context


    started = []
    kind = type(launch_worker._rank_context(120.0).Process())  # the fork server is up before the count starts
    original = kind.start

    def start(self):
        if len(started) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        original(self)
        started.append(self)

    assert kind in (mp_context.SpawnProcess, getattr(mp_context, "ForkServerProcess", None))
    monkeypatch.setattr(kind, "start", start)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"^could not start rank 2 of a local world of 3: BlockingIOError: "
                                           r"\[Errno 11\] Resource temporarily unavailable; the 2 ranks already "
                                           r"started were stopped$") as info:
        LocalWorld(3)
    assert time.monotonic() - t0 < 10 * time_scale and info.value.ranks == [2]
    assert len(started) == 2 and all(p._closed for p in started)  # killed, joined and closed


# -- torchrun-style start ----------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from cocoweave.backends.torch.agreement import agree
    from cocoweave.launch import in_torchrun, init_from_env, shutdown
    sys.path.insert(0, os.environ["TEST_DIR"])
    from test_launch import listening_addresses
    assert in_torchrun()
    rank, world_size, device = init_from_env(timeout_s=30)
    agree("fp", "program fingerprint")
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    print(f"RESULT {rank} {world_size} {device} {t.tolist()}", flush=True)
    print("LISTEN " + " ".join(listening_addresses([os.getpid()])), flush=True)
    shutdown()
    assert not dist.is_initialized()
""")


def test_init_from_env_under_torchrun_style_env(tmp_path, time_scale):
    script = tmp_path / "rank.py"
    script.write_text(_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TEST_DIR": os.path.dirname(__file__)}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=60 * time_scale)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, out
        gpus = torch.cuda.device_count()  # init_from_env puts local rank r on GPU r mod the GPUs, if any
        assert f"RESULT {rank} 2 {f'cuda:{rank % gpus}' if gpus else 'cpu'} [3.0, 3.0]" in out
        listening = out.split("LISTEN", 1)[1].split()
        assert listening and all(a in LOOPBACK for a in listening), out  # rank 0's store, Gloo's pairs


def test_init_from_env_names_missing_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    assert not in_torchrun()
    with pytest.raises(BackendError, match="needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"):
        init_from_env()


def test_torchrun_rank_on_a_gpu_host_gets_its_gpu_and_nccl_with_gloo_beside(monkeypatch):
    """One GPU per local rank: NCCL, made with Gloo beside it so that a CPU metadata tensor still reduces; ranks
    sharing a GPU: Gloo with CUDA tensors. The device comes back so that examples build their model on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.torchrun_device(1, 2) == (torch.device("cuda", 1), "nccl")
    assert launch.torchrun_device(2, 3) == (torch.device("cuda", 0), "gloo")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch_torchrun, "_rank_store", lambda *args: None)
    monkeypatch.setattr(launch_torchrun, "_RANK", {})
    monkeypatch.setattr(faults, "track", lambda progress: None)
    made = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: made.append(backend))
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("COCOWEAVE_BACKEND", raising=False)
    assert init_from_env() == (1, 2, torch.device("cuda", 1))
    assert made == ["cpu:gloo,cuda:nccl"]


def test_torchrun_rank_without_a_gpu_is_told_nccl_needs_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.torchrun_device(0, 4) == (torch.device("cpu"), "gloo")
    with pytest.raises(BackendError, match="nccl needs CUDA"):
        launch.torchrun_device(0, 1, "nccl")


# -- the trace recorder on its own -------------------------------------------------------------------------


def test_trace_json_is_valid_with_one_track_per_rank(tmp_path):
    tracers = [Tracer(rank) for rank in range(3)]
    for tracer in tracers:
        with tracer.span("kernel", chunk=1, bytes=64):
            pass
        tracer.add("send", time.perf_counter_ns(), time.perf_counter_ns() + 1000, stream="p2p")
    off = Tracer(enabled=False)
    with off.span("nothing"):
        pass
    assert off.events() == []
    path = tmp_path / "t.json"
    merge_and_write([t.events() for t in tracers], path)
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["pid"] for e in spans}) == [0, 1, 2]
    assert {e["pid"] for e in trace["traceEvents"] if e.get("name") == "process_name"} == {0, 1, 2}
    kernel = next(e for e in spans if e["name"] == "kernel")
    assert kernel["args"] == {"bytes": 64, "chunk": 1} and kernel["cat"] == "compute"
    assert min(e["ts"] for e in spans) == 0
