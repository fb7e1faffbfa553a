"""cocoweave.elastic: batch policies split a step over any world size as promised, the sampler's order survives a
resize through its state, AdaScale's gain follows the gradient noise it measures (the time and cost of a job under a
resize plan: tests/cluster/planning/test_resize.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoweave import elastic
from cocoweave.elastic import (
    AdaScale,
    BatchPolicy,
    ElasticSampler,
    gradient_moments,
    split_evenly,
)
from cocoweave.errors import ElasticError

# ---------------------------------------------------------------------------------------------------------
# Batch policies
# ---------------------------------------------------------------------------------------------------------


def test_keep_global_splits_an_uneven_batch_over_the_ranks():
    plan = BatchPolicy.keep_global(12).plan(5)
    assert plan.global_batch == 12 and plan.shares == (3, 3, 2, 2, 2) and plan.lr_scale == 1.0
    assert [plan.rank_range(r) for r in range(5)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10),
                                                      range(10, 12)]
    assert plan.accumulation == 1


def test_a_micro_batch_cap_gives_gradient_accumulation_with_even_micro_batches():
    plan = BatchPolicy.keep_global(10, micro_batch=2).plan(2)  # 5 samples per rank, at most 2 at once
    assert plan.micro_batches(0) == [range(0, 2), range(2, 4), range(4, 5)]
    assert plan.micro_batches(1) == [range(5, 7), range(7, 9), range(9, 10)]
    assert plan.accumulation == 3
    plan3 = BatchPolicy.keep_global(12, micro_batch=3).plan(3)  # 4 samples per rank, cap 3: 2 + 2, not 3 + 1
    assert [len(m) for m in plan3.micro_batches(2)] == [2, 2]


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 200), world=st.integers(1, 64), cap=st.none() | st.integers(1, 16))
def test_every_sample_of_a_step_goes_to_exactly_one_micro_batch_and_the_weights_give_the_mean(batch, world, cap):
    if batch < world:
        with pytest.raises(ElasticError, match="every rank needs at least one sample"):
            BatchPolicy.keep_global(batch, cap).plan(world)
        return
    plan = BatchPolicy.keep_global(batch, cap).plan(world)
    assert max(plan.shares) - min(plan.shares) <= 1
    parts = [m for r in range(world) for m in plan.micro_batches(r)]
    assert [i for m in parts for i in m] == list(range(batch))  # contiguous, in rank order, no gap or overlap
    for r in range(world):
        mine = plan.micro_batches(r)
        assert all(len(m) >= 1 for m in mine)
        if cap is not None:
            assert all(len(m) <= cap for m in mine) and len(mine) == math.ceil(plan.shares[r] / cap)
    # averaging the ranks' weighted micro-batch means gives the mean over the global batch: every sample counts 1/B
    per_sample = [plan.weight(len(m)) / len(m) / world for m in parts]
    assert all(math.isclose(w, 1 / batch) for w in per_sample)


def test_scale_keeps_each_ranks_batch_and_scales_the_learning_rate_by_its_rule():
    linear, sqrt = BatchPolicy.scale(16, 4, "linear"), BatchPolicy.scale(16, 4, "sqrt")
    assert [linear.batch_at(w) for w in (1, 2, 4, 8)] == [4, 8, 16, 32]
    assert [linear.lr_scale(w) for w in (2, 4, 8)] == [0.5, 1.0, 2.0]
    assert sqrt.lr_scale(8) == pytest.approx(math.sqrt(2)) and sqrt.lr_scale(2) == pytest.approx(math.sqrt(0.5))
    assert BatchPolicy.scale(16, 4, "adascale").lr_scale(8) == 1.0  # AdaScale's gain is applied per step
    plan = linear.plan(3)
    assert plan.global_batch == 12 and plan.shares == (4, 4, 4) and plan.lr_scale == 0.75


@pytest.mark.parametrize("make, message", [
    (lambda: BatchPolicy.keep_global(0), "the global batch must be an integer of at least 1, got 0"),
    (lambda: BatchPolicy("keep_global", 8, lr_rule="sqrt"), "applies to the scale policy only"),
    (lambda: BatchPolicy("scale", 8), "the scale policy needs a learning-rate rule"),
    (lambda: BatchPolicy.scale(8, 3), "does not split evenly over 3 base ranks"),
    (lambda: BatchPolicy.scale(8, 2, "cubic"), "one of linear, sqrt, adascale; got 'cubic'"),
    (lambda: BatchPolicy("grow", 8), "must be one of keep_global, scale"),
    (lambda: BatchPolicy.keep_global(8, micro_batch=0), "micro-batch cap"),
    (lambda: BatchPolicy.keep_global(3).plan(4), "3 samples cannot be split over 4 ranks"),
])
def test_a_policy_it_cannot_use_is_one_sentence(make, message):
    with pytest.raises(ElasticError, match=message):
        make()


def test_split_evenly_matches_torch_tensor_split():
    for total, parts in [(12, 5), (10, 4), (3, 3), (7, 1)]:
        assert list(split_evenly(total, parts)) == [len(t) for t in torch.tensor_split(torch.arange(total), parts)]


# ---------------------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------------------


def _train_through_resizes(sampler: ElasticSampler, policy: BatchPolicy, phases: list[tuple[int, int]]) -> list[int]:
    """Consume `steps` steps at each (world, steps) phase, handing the sampler over through its state as a
    restart from a checkpoint does; returns the samples the ranks got, in order."""
    seen: list[int] = []
    state = sampler.state_dict()
    for world, steps in phases:
        restarted = ElasticSampler(sampler.num_samples, seed=sampler.seed)
        restarted.load_state_dict(state)
        plan = policy.plan(world)
        for _ in range(steps):
            batch = restarted.next_batch(plan.global_batch)
            seen += [batch[i] for r in range(world) for m in plan.micro_batches(r) for i in m]
        state = restarted.state_dict()
    return seen


@pytest.mark.parametrize("policy", [BatchPolicy.keep_global(10, micro_batch=2), BatchPolicy.scale(8, 4, "sqrt")])
def test_no_sample_is_skipped_or_seen_twice_within_an_epoch_across_4_2_3_ranks(policy):
    sampler = ElasticSampler(25, seed=3)
    seen = _train_through_resizes(sampler, policy, [(4, 3), (2, 4), (3, 5)])
    epochs = [seen[i:i + 25] for i in range(0, len(seen), 25)]
    assert len(epochs) >= 3
    for e, got in enumerate(epochs):
        assert len(set(got)) == len(got)  # the last, partial epoch included
        if len(got) == 25:
            assert got == sampler.order(e) and sorted(got) == list(range(25))
    assert seen == ElasticSampler(25, seed=3).indices(0, len(seen))  # the order does not depend on the world sizes


def test_the_order_is_fixed_by_seed_and_epoch():
    a, b = ElasticSampler(50, seed=1), ElasticSampler(50, seed=1)
    assert a.order(0) == b.order(0) and a.order(0) != a.order(1) and a.order(0) != ElasticSampler(50, 2).order(0)
    assert ElasticSampler(5, shuffle=False).indices(3, 4) == [3, 4, 0, 1]
    a.next_batch(70)
    assert (a.epoch, a.position) == (1, 70)


def test_a_sampler_state_of_another_order_is_refused():
    saved = ElasticSampler(25, seed=0).state_dict()
    with pytest.raises(ElasticError, match="is not this sampler's"):
        ElasticSampler(26, seed=0).load_state_dict(saved)
    with pytest.raises(ElasticError, match="position must be an integer of at least 0"):
        ElasticSampler(25).load_state_dict(saved | {"position": -1})
    with pytest.raises(ElasticError, match="needs integer num_samples"):
        ElasticSampler(25).load_state_dict({"seed": 0})


# ---------------------------------------------------------------------------------------------------------
# AdaScale
# ---------------------------------------------------------------------------------------------------------


def _noisy_steps(ada: AdaScale, ranks: int, rank_batch: int, var: float, mean: torch.Tensor, steps: int,
                 seed: int = 0) -> None:
    """Feed AdaScale `steps` steps of `ranks` local gradients, each the mean of `rank_batch` per-sample gradients
    with per-sample covariance var/d * I around `mean`."""
    gen = torch.Generator().manual_seed(seed)
    d = mean.numel()
    for _ in range(steps):
        samples = mean + torch.randn(ranks, rank_batch, d, generator=gen, dtype=torch.float64) * math.sqrt(var / d)
        local = samples.mean(1)
        ada.update(float(local.pow(2).sum()), float(local.mean(0).pow(2).sum()), ranks, rank_batch)


def test_adascale_estimates_the_gradient_noise_and_gives_the_papers_gain():
    mean = torch.full((200,), 0.05, dtype=torch.float64)  # |mean|^2 = 0.5
    ada = AdaScale(base_batch=8)
    _noisy_steps(ada, ranks=4, rank_batch=4, var=4.0, mean=mean, steps=400)
    assert ada.var == pytest.approx(4.0, rel=0.1) and ada.sqr == pytest.approx(0.5, rel=0.1)
    assert ada.noise_scale == pytest.approx(8.0, rel=0.2)
    expected = (4.0 / 8 + 0.5) / (4.0 / 16 + 0.5)  # batch 16 against the base batch 8
    assert ada.gain(16) == pytest.approx(expected, rel=0.05)
    assert ada.gain(8) == pytest.approx(1.0)
    assert 1.0 < ada.gain(64) < 8.0 and 0.25 < ada.gain(2) < 1.0  # between 1 and the batch ratio


def test_adascale_gain_is_the_batch_ratio_for_pure_noise_and_one_without_noise():
    noise = AdaScale(8)
    _noisy_steps(noise, 4, 4, var=1.0, mean=torch.zeros(100, dtype=torch.float64), steps=50)
    assert noise.gain(32) == pytest.approx(4.0, rel=0.1)
    exact = AdaScale(8)
    _noisy_steps(exact, 4, 4, var=0.0, mean=torch.ones(100, dtype=torch.float64), steps=5)
    assert exact.gain(32) == pytest.approx(1.0) and exact.gain(2) == pytest.approx(1.0)


def test_adascale_without_an_estimate_scales_linearly_and_counts_progress():
    ada = AdaScale(8)
    ada.update(1.0, 1.0, ranks=1, rank_batch=8)  # one rank: no variance estimate
    assert ada.count == 0 and ada.gain(4) == 0.5
    assert ada.step(16) == 2.0 and ada.step(8) == 1.0 and ada.progress == 3.0


def test_adascale_state_round_trips_and_refuses_another_base_batch():
    ada = AdaScale(8)
    _noisy_steps(ada, 2, 4, var=1.0, mean=torch.ones(10, dtype=torch.float64), steps=3)
    ada.step(16)
    copy = AdaScale(8)
    copy.load_state_dict(ada.state_dict())
    assert copy.state_dict() == ada.state_dict() and copy.gain(24) == ada.gain(24)
    with pytest.raises(ElasticError, match="base batch of 8"):
        AdaScale(4).load_state_dict(ada.state_dict())


def _moments_on_ranks(rank: int, world_size: int) -> tuple[float, float]:
    grads = [torch.full((3,), float(rank + 1)), torch.full((2, 2), float(rank) - 1.0)]
    return gradient_moments(grads)


def test_gradient_moments_over_ranks_are_the_sum_of_squares_and_the_mean_squared(local_world):
    results = local_world(2).run(_moments_on_ranks)
    g0 = torch.cat([torch.full((3,), 1.0), torch.full((4,), -1.0)])
    g1 = torch.cat([torch.full((3,), 2.0), torch.full((4,), 0.0)])
    expected = (float(g0.pow(2).sum() + g1.pow(2).sum()), float(((g0 + g1) / 2).pow(2).sum()))
    assert results == [pytest.approx(expected)] * 2
    assert gradient_moments([torch.ones(4)]) == (4.0, 4.0)  # one process: the local gradient is the mean


def _moments_of_a_tensor_parallel_model(rank: int, world_size: int) -> tuple[float, float]:
    """dp 2 x tp 2: a weight sharded over tp (a DTensor's gradient) and a replicated bias; replica d's whole
    gradients are (d + 1) * W and (d - 1) * b."""
    from torch.distributed.device_mesh import init_device_mesh

    from cocoweave.sharding import replicate_parameter, shard_parameter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    d, t = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    whole_w, whole_b = torch.arange(8.0).reshape(4, 2), torch.tensor([1.0, -2.0])
    w = shard_parameter(((d + 1) * whole_w).chunk(2, 0)[t].clone(), mesh["tp"], 0)
    b = replicate_parameter((d - 1) * whole_b, mesh["tp"])
    return gradient_moments([w.detach(), b.detach()], mesh.get_group("dp"))


def test_gradient_moments_of_a_tensor_parallel_model_count_each_part_once(local_world):
    """AdaScale's moments are the whole model's and the same on every rank (not each tensor-parallel part's)."""
    whole_w, whole_b = torch.arange(8.0).reshape(4, 2), torch.tensor([1.0, -2.0])
    g = [torch.cat([((d + 1) * whole_w).reshape(-1), (d - 1) * whole_b]) for d in range(2)]
    expected = (float(g[0].pow(2).sum() + g[1].pow(2).sum()), float(((g[0] + g[1]) / 2).pow(2).sum()))
    assert local_world(4).run(_moments_of_a_tensor_parallel_model) == [pytest.approx(expected)] * 4


def test_a_dataloader_with_workers_yields_the_samplers_global_order_from_its_position():
    from torch.utils.data import DataLoader

    sampler = ElasticSampler(23, seed=5)
    sampler.next_batch(7)  # resumed mid-epoch
    dataset = [100 + i for i in range(23)]
    loader = DataLoader(dataset, sampler=sampler, batch_size=4, num_workers=2)
    assert len(sampler) == 16
    got = [int(x) for batch in loader for x in batch]
    assert got == [100 + i for i in ElasticSampler(23, seed=5).indices(7, 16)]  # the rest of epoch 0
    assert sampler.position == 23
    again = [int(x) for batch in loader for x in batch]  # the next epoch, a new permutation
    assert again == [100 + i for i in sampler.order(1)] and sorted(again) == dataset


def test_gradient_statistics_of_a_rank_without_gradients_reduce_on_a_device_nccl_takes(monkeypatch):
    """NCCL alone refuses CPU tensors: the zero a rank without gradients contributes is on its GPU (faked: meta)."""
    from cocoweave.backends.torch import placement

    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(placement, "compute_device", lambda: torch.device("meta"))

    def all_reduce(t, group=None):
        seen.append(t.device.type)
        raise RuntimeError("stop")

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(RuntimeError, match="stop"):
        elastic.gradient_moments([])
    assert seen == ["meta"]
