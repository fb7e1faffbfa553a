"""Elastic training under torchrun (how revocable machines are survived): examples/train_gpt.py with one rank
killed by SIGKILL mid-run restarts, resumes from its last complete checkpoint and logs every step exactly once,
with the losses of an uninterrupted run. With one torchrun agent per rank joining and leaving (`--nnodes 2:4`),
the job shrinks from 4 ranks to 2 and grows to 3: keep_global trains the loss curve of an uninterrupted 4-rank
run and every sample of each epoch once; scale follows its learning-rate rule and the one-process replay."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest

from cocoweave.elastic import ElasticSampler, split_evenly
from cocoweave.launch import listening_store

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"
STEPS, EVERY, KILL_AT = 12, 4, 9


def _train_gpt():
    """examples/train_gpt.py as a module (its module-level functions can be sent to ranks)."""
    module = sys.modules.get("train_gpt")
    if module is None:
        spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_gpt"] = module
        spec.loader.exec_module(module)
    return module


def _log(path: Path) -> tuple[list[int], list[float], list[str]]:
    steps, losses, notes = [], [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            notes.append(line)
        else:
            step, loss = line.split()
            steps.append(int(step))
            losses.append(float(loss))
    return steps, losses, notes


def test_a_rank_killed_mid_run_restarts_from_the_last_checkpoint_without_lost_or_repeated_steps(
        tmp_path, local_world):
    marker, ckpt, log = tmp_path / "killed-once", tmp_path / "ckpt", tmp_path / "steps.log"
    env = dict(os.environ, COCOWEAVE_FAULT=f"rank=1,stage={KILL_AT},label=train_step,action=kill,once={marker}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc-per-node=2", "--max-restarts=2",
           "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(SCRIPT), "--steps", str(STEPS),
           "--tensor-parallel", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY), "--log-file", str(log),
           "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert f"injected fault: rank 1 kill at stage {KILL_AT} (train_step)" in output and marker.exists()

    steps, losses, notes = _log(log)
    assert steps == list(range(STEPS)), steps  # every step exactly once
    resumed_at = KILL_AT // EVERY * EVERY
    assert notes == [f"# resumed at step {resumed_at}"]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]

    gpt = _train_gpt()
    cfg = gpt.Config(steps=STEPS, tensor_parallel=2, world_size=2)
    uninterrupted = local_world(2).run(gpt.train_parallel, asdict(cfg))[0]["losses"]
    assert losses == uninterrupted


# ---------------------------------------------------------------------------------------------------------
# Resizing 4 -> 2 -> 3 ranks
# ---------------------------------------------------------------------------------------------------------

# 25 samples (windows of 33 characters), a global batch of 10 (3, 3, 2, 2 on 4 ranks; 5, 5 on 2; 4, 3, 3 on 3) in
# micro-batches of at most 2: uneven shares, gradient accumulation and an epoch's end every 2.5 steps.
SAMPLES, BATCH, MICRO, EVERY_2 = 25, 10, 2, 2
SHRINK_AT, GROW_AT = 5, 9  # the step at which two agents are killed, and the one at which a third agent joins
TRAIN = ["--steps", str(STEPS), "--tensor-parallel", "1", "--batch", str(BATCH), "--micro-batch", str(MICRO),
         "--corpus-chars", str(SAMPLES * 32 + 1)]


def _samples_log(path: Path) -> tuple[list[int], list[int], list[float], list[list[list[int]]], list[str]]:
    """(steps, data-parallel sizes, learning rates, per step each rank's samples, notes) of a --samples-log."""
    steps, worlds, lrs, shares, notes = [], [], [], [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            notes.append(line)
            continue
        step, world, lr, ranks = line.split()
        steps.append(int(step))
        worlds.append(int(world))
        lrs.append(float(lr))
        shares.append([[int(i) for i in r.split(",")] for r in ranks.split("|")])
    return steps, worlds, lrs, shares, notes


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (torchrun starts its workers in sessions of their own)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                out.append(int(d.name))
    return out


def _kill_agent(agent: subprocess.Popen) -> None:
    """SIGKILL a torchrun agent, then its workers (the agent first: it would restart them)."""
    workers = _children(agent.pid)
    agent.kill()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def _tails(folder: Path) -> str:
    """The end of every agent's output."""
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(folder.glob("agent-*.log")))


def _wait_for(paths: list[Path], agents: dict[str, subprocess.Popen], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        dead = {n: a.returncode for n, a in agents.items() if a.poll() is not None}
        assert not dead and time.monotonic() < deadline, f"waiting for {[p.name for p in paths]}: agents {dead} ended"
        time.sleep(0.2)


def test_keep_global_through_4_2_3_ranks_trains_the_uninterrupted_curve_and_every_sample_once(tmp_path, local_world):
    """Four agents (one rank each) train; at step SHRINK_AT two of them are SIGKILLed with their ranks, the other two
    re-rendezvous and resume from the last checkpoint at 2 ranks; at step GROW_AT a new agent joins and the job
    resumes at 3 ranks."""
    store = listening_store("127.0.0.1", 0, 60.0)  # the rendezvous store, outliving every agent
    ckpt, log, samples, out = tmp_path / "ckpt", tmp_path / "steps.log", tmp_path / "samples.log", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "COCOWEAVE_FAULT"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), GLOO_SOCKET_IFNAME="lo",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # a store per round, served by its rank 0
               LOGLEVEL="INFO")  # the agents log their rounds and restarts: a failure below prints them

    def agent(name: str, fault: str | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
               "--max-restarts=3", "--monitor-interval=0.2", "--rdzv-backend=c10d", "--local-addr=127.0.0.1",
               f"--rdzv-endpoint=127.0.0.1:{store.port}", f"--rdzv-id=elastic-{store.port}",
               "--rdzv-conf=is_host=false,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
               str(SCRIPT), *TRAIN, "--ckpt-dir", str(ckpt), "--ckpt-every", str(EVERY_2), "--log-file", str(log),
               "--samples-log", str(samples), "--out", str(out)]
        with open(tmp_path / f"agent-{name}.log", "w") as f:
            return subprocess.Popen(cmd, cwd=tmp_path, env=env | ({"COCOWEAVE_FAULT": fault} if fault else {}),
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    # A and B stay; one of their ranks pauses at GROW_AT (the other waits in a collective) until the job regroups.
    # C and D pause at SHRINK_AT, where they are killed.
    grow = tmp_path / "grow"
    sleep = "label=train_step,action=sleep,seconds=300"
    agents = {n: agent(n, f"stage={GROW_AT},{sleep},once={grow}") for n in "AB"}
    agents |= {n: agent(n, f"stage={SHRINK_AT},{sleep},once={tmp_path / ('shrink-' + n)}") for n in "CD"}
    try:
        _wait_for([tmp_path / "shrink-C", tmp_path / "shrink-D"], agents)
        for n in "CD":  # A's and B's ranks then fail in their collective, and their agents restart them
            _kill_agent(agents.pop(n))
        _wait_for([grow], agents)
        agents["E"] = agent("E")
        codes = {n: a.wait(timeout=240) for n, a in agents.items()}
    except BaseException:
        print(_tails(tmp_path))
        raise
    finally:
        for a in agents.values():
            if a.poll() is None:
                _kill_agent(a)
    assert codes == {"A": 0, "B": 0, "E": 0}, _tails(tmp_path)
    try:
        _check_keep_global(samples, log, out, local_world, tmp_path)
    except AssertionError:
        print(_tails(tmp_path))
        raise


def _check_keep_global(samples: Path, log: Path, out: Path, local_world, folder: Path) -> None:
    """What the 4 -> 2 -> 3 run of keep_global must have logged and computed."""
    steps, worlds, lrs, shares, notes = _samples_log(samples)
    assert steps == list(range(STEPS)), steps  # every step once
    resumed = [SHRINK_AT // EVERY_2 * EVERY_2, GROW_AT // EVERY_2 * EVERY_2]
    assert notes[:2] == [f"# resumed at step {s}" for s in resumed]
    # Once (CI, 2026-12-05) the job was restarted once more after its last step and resumed at its last checkpoint
    # with nothing left to train; the cause is not known (not reproduced in 40 runs here, loaded or not, and that
    # run kept no agent logs). Such a round changes no number checked here: it is allowed and reported with the
    # agents' logs (INFO), but no other extra round is.
    assert all(n == f"# resumed at step {STEPS}" for n in notes[2:]), notes
    if notes[2:]:
        warnings.warn(f"the finished job was restarted {len(notes) - 2} more time(s):\n{_tails(folder)}", stacklevel=1)
    assert worlds == [4] * resumed[0] + [2] * (resumed[1] - resumed[0]) + [3] * (STEPS - resumed[1])
    assert lrs == [3e-3] * STEPS
    for world, ranks in zip(worlds, shares):
        assert [len(r) for r in ranks] == list(split_evenly(BATCH, world))  # uneven shares: 3, 3, 2, 2 / 4, 3, 3
    seen = [i for ranks in shares for r in ranks for i in r]
    assert seen == ElasticSampler(SAMPLES, seed=0).indices(0, STEPS * BATCH)  # the global order, whatever the sizes
    for start in range(0, len(seen), SAMPLES):  # every sample of each epoch once (the last one is partial)
        epoch = seen[start:start + SAMPLES]
        assert len(set(epoch)) == len(epoch) and (len(epoch) < SAMPLES or sorted(epoch) == list(range(SAMPLES)))

    losses = [float(line.split()[1]) for line in log.read_text().splitlines() if not line.startswith("#")]
    gpt = _train_gpt()
    cfg = gpt.Config(steps=STEPS, tensor_parallel=1, world_size=4, batch=BATCH, micro_batch=MICRO,
                     corpus_chars=SAMPLES * 32 + 1)
    uninterrupted = local_world(4).run(gpt.train_parallel, asdict(cfg))[0]
    assert uninterrupted["worlds"] == [4] * STEPS
    assert losses == pytest.approx(uninterrupted["losses"], abs=1e-5)
    result = json.loads((out / "losses.json").read_text())  # rank 0 compared with one process, replaying the sizes
    assert result["worlds"] == worlds and result["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("rule", ["sqrt", "adascale"])
def test_scale_through_4_2_3_ranks_follows_its_learning_rate_rule_and_the_one_process_replay(rule, tmp_path,
                                                                                              local_world):
    """2 samples per rank (a global batch of 8 at the base world of 4), checkpoints every 2 steps, resumed at 2
    ranks, then at 3."""
    gpt = _train_gpt()
    ckpt, samples = tmp_path / "ckpt", tmp_path / "samples.log"
    fields = dict(tensor_parallel=1, batch=8, batch_policy="scale", lr_rule=rule, corpus_chars=SAMPLES * 32 + 1)
    for world, steps in ((4, 2), (2, 4), (3, 6)):
        cfg = gpt.Config(steps=steps, world_size=world, **fields)
        result = local_world(world).run(gpt.train_parallel, asdict(cfg), str(ckpt), 2, None, str(samples))[0]
    assert result["worlds"] == [4, 4, 2, 2, 3, 3] and result["base_world"] == 4
    _, _, _, shares, _ = _samples_log(samples)
    assert [[len(r) for r in ranks] for ranks in shares] == [[2] * w for w in result["worlds"]]
    seen = [i for ranks in shares for r in ranks for i in r]
    assert seen == ElasticSampler(SAMPLES, seed=0).indices(0, 8 + 8 + 4 + 4 + 6 + 6)
    lr0 = gpt.Config.lr
    if rule == "sqrt":
        assert result["lrs"] == pytest.approx([lr0] * 2 + [lr0 * math.sqrt(0.5)] * 2 + [lr0 * math.sqrt(0.75)] * 2)
    else:  # AdaScale's gain lies between 1 and the batch ratio k, strictly when the gradient has noise and signal
        assert result["lrs"][:2] == pytest.approx([lr0] * 2)
        assert all(lr0 * 0.5 < lr < lr0 for lr in result["lrs"][2:4])
        assert all(lr0 * 0.75 < lr < lr0 for lr in result["lrs"][4:])
        assert result["adascale"]["count"] == 6 and result["adascale"]["progress"] < 6
    reference = gpt.train_reference(gpt.Config(steps=6, world_size=4, **fields), result["worlds"], 4)
    assert result["losses"] == pytest.approx(reference, abs=1e-5)
