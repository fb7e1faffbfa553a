"""RankEnv: a process's place in its world from torchrun's or SLURM's variables (or torch.distributed's), one sentence
for malformed or contradicting ones, and a new launcher supported by one more row of LAUNCHERS."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cocoweave import faults, launch, rankenv
from cocoweave.errors import OptimizerError, SettingsError
from cocoweave.launch import torchrun as launch_torchrun
from cocoweave.optim import DistributedAdamW
from cocoweave.rankenv import LAUNCHERS, Launcher, RankEnv, missing_to_join

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
         "SLURM_NODEID": "1"}


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher's variables in os.environ (the suite may itself run under one)."""
    for launcher in LAUNCHERS:
        for name in (launcher.rank, launcher.world_size, launcher.local_rank, launcher.local_world_size,
                     launcher.node_rank, launcher.marker, launcher.tasks_per_node, *rankenv.RENDEZVOUS):
            if name:
                monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COCOWEAVE_BACKEND", raising=False)
    return monkeypatch


def test_a_lone_process_is_rank_0_of_1_with_this_machines_cores():
    env = RankEnv.from_env({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (0, 1, 0, 1, None)
    assert env.cores == len(os.sched_getaffinity(0)) and env.threads is None
    assert env.backend is None and RankEnv.from_env({"COCOWEAVE_BACKEND": "gloo"}).backend == "gloo"


def test_torchrun_variables_place_the_rank():
    env = RankEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                            "OMP_NUM_THREADS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 1, 2, 1)
    assert (env.launcher, env.master_addr, env.master_port, env.threads) == ("torchrun", "10.0.0.1", 29500, 2)
    # without LOCAL_* the whole world is local, as torchrun's single-node default
    assert RankEnv.from_env({"RANK": "2", "WORLD_SIZE": "3"}).local_rank == 2


def test_slurm_variables_alone_place_the_rank():
    env = RankEnv.from_env(SLURM)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)
    assert env.launcher == "SLURM"


def test_srun_without_ntasks_per_node_takes_the_local_world_size_from_the_per_node_list():
    """`srun -N 3 -n 7` sets SLURM_TASKS_PER_NODE="3(x2),1" and no SLURM_NTASKS_PER_NODE: without the list every
    rank would count the whole world as local, and ranks with a GPU each would be given Gloo instead of NCCL."""
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"} | {"SLURM_NTASKS": "7",
                                                                             "SLURM_TASKS_PER_NODE": "3(x2),1"}
    assert RankEnv.from_env(env).local_world_size == 3
    last = env | {"SLURM_NODEID": "2", "SLURM_LOCALID": "0", "SLURM_PROCID": "6"}
    assert RankEnv.from_env(last).local_world_size == 1
    assert rankenv.tasks_per_node("4") == [4] and rankenv.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(SettingsError, match=r"^SLURM_TASKS_PER_NODE must list task counts like '2\(x3\),1', "
                                            r"got '2\(x'$"):
        RankEnv.from_env(env | {"SLURM_TASKS_PER_NODE": "2(x"})
    with pytest.raises(SettingsError, match=r"^SLURM_NODEID=3 names no node of SLURM_TASKS_PER_NODE='3\(x2\),1' "
                                            r"\(3 nodes\)$"):
        RankEnv.from_env(env | {"SLURM_NODEID": "3"})
    with pytest.raises(SettingsError, match="SLURM_LOCALID=1 must be below SLURM_TASKS_PER_NODE=1"):
        RankEnv.from_env(env | {"SLURM_NODEID": "2"})


def test_hand_set_torchrun_variables_that_contradict_slurm_are_one_sentence():
    with pytest.raises(SettingsError, match=r"^RANK=2 \(torchrun\) and SLURM_PROCID=5 \(SLURM\) disagree about "
                                            r"this process's rank; unset one launcher's variables or make them "
                                            r"agree$"):
        RankEnv.from_env({**SLURM, "RANK": "2", "WORLD_SIZE": "8"})
    agreeing = RankEnv.from_env({**SLURM, "RANK": "5", "WORLD_SIZE": "8"})
    assert (agreeing.rank, agreeing.world_size, agreeing.local_rank) == (5, 8, 1)


def test_torchrun_started_inside_a_slurm_step_wins():
    """srun starts one torchrun agent per node; its workers see the agent's SLURM_* and their own RANK."""
    env = RankEnv.from_env({**SLURM, "RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                            "TORCHELASTIC_RUN_ID": "job"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (13, 16, 1, "torchrun")


@pytest.mark.parametrize(("given", "message"), [
    ({"RANK": "one", "WORLD_SIZE": "2"}, r"^RANK must be a whole number of at least 0, got 'one'$"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "-2"}, r"^SLURM_NTASKS must be a whole number of at least 0, got '-2'$"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"^RANK=4 must be below WORLD_SIZE=4 \(the rank within the world size\)$"),
    ({"RANK": "5", "SLURM_PROCID": "5", "SLURM_NTASKS": "4"}, r"^RANK=5 must be below SLURM_NTASKS=4 "),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, r"^MASTER_PORT must be a whole number"),
])
def test_malformed_variables_are_one_sentence_naming_them(given, message):
    with pytest.raises(SettingsError, match=message):
        RankEnv.from_env(given)


def test_torch_distributed_once_initialised_is_the_authority(bare_env):
    bare_env.setenv("RANK", "0")
    bare_env.setenv("WORLD_SIZE", "1")
    bare_env.setattr(dist, "is_initialized", lambda: True)
    bare_env.setattr(dist, "get_rank", lambda group=None: 2)
    bare_env.setattr(dist, "get_world_size", lambda group=None: 3)
    assert (RankEnv.current().rank, RankEnv.current().world_size) == (2, 3)


def _stub_process_group(monkeypatch) -> list[dict]:
    """init_from_env up to init_process_group, which records its arguments instead of joining a world."""
    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch_torchrun, "_rank_store", lambda *args: None)
    monkeypatch.setattr(launch_torchrun, "_RANK", {})
    monkeypatch.setattr(faults, "track", lambda progress: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.append({"backend": backend, **kw}))
    return made


def test_init_from_env_joins_under_srun_with_the_rendezvous_exported(bare_env):
    made = _stub_process_group(bare_env)
    for key, value in {**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():
        bare_env.setenv(key, value)
    assert launch.init_from_env() == (5, 8, torch.device("cpu"))
    assert made[0]["rank"] == 5 and made[0]["world_size"] == 8 and made[0]["backend"] == "gloo"


def test_init_from_env_under_srun_names_the_missing_rendezvous(bare_env):
    for key, value in SLURM.items():
        bare_env.setenv(key, value)
    assert missing_to_join() == ["MASTER_ADDR", "MASTER_PORT"]
    with pytest.raises(Exception, match=r"^init_from_env needs MASTER_ADDR, MASTER_PORT in the environment"):
        launch.init_from_env()


def test_a_new_launcher_is_one_row(bare_env):
    """Open MPI's mpirun: one Launcher row, and launch, the optimizer and RankEnv all see its ranks."""
    mpi = Launcher("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE")
    bare_env.setattr(rankenv, "LAUNCHERS", (*LAUNCHERS, mpi))
    for key, value in {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                       "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():
        bare_env.setenv(key, value)
    env = RankEnv.from_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (3, 4, 1, 2, "Open MPI")
    with pytest.raises(OptimizerError, match=r"one of 4 ranks"):  # the optimizer refuses to train alone
        DistributedAdamW(torch.nn.Linear(2, 2).parameters())
    made = _stub_process_group(bare_env)
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    bare_env.setenv("MASTER_PORT", "29500")
    assert launch.init_from_env()[:2] == (3, 4) and made[0]["rank"] == 3
