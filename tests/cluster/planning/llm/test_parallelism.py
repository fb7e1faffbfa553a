"""Layouts: uneven pipeline stages split as Llama 3 and BLOOM split theirs, or as stated, and refused when they
cannot be."""

from __future__ import annotations

import pytest

from cocoweave.cluster.planning.llm.parallelism import ParallelConfig, split_layers
from cocoweave.cluster.planning.llm.spec import TransformerSpec

SPEC = TransformerSpec(layers=10, hidden=256, heads=8, vocab=1000, seq_len=128, global_batch=32)


@pytest.mark.parametrize("layers, pp, split", [
    (126, 16, (7,) + (8,) * 14 + (7,)),  # Llama 3 405B (Dubey et al. 2024, sec. 3.3.2): one layer less first and last
    (70, 12, (5,) + (6,) * 10 + (5,)),  # BLOOM 176B on 12 stages
    (96, 8, (12,) * 8),  # even: unchanged
    (10, 4, (2, 3, 3, 2)),
    (11, 4, (2, 3, 3, 3)),  # more rest than middle stages: the last next, the first (most in flight) last
    (5, 1, (5,)),
])
def test_split_gives_the_rest_to_the_middle_stages(layers: int, pp: int, split: tuple[int, ...]):
    assert split_layers(layers, pp) == split and sum(split) == layers


def test_uneven_and_stated_stages_are_layouts_interleaving_is_not():
    assert ParallelConfig(pp=4, dp=1).problems(SPEC, 8) == []
    assert ParallelConfig(pp=4, dp=1, stages=(1, 4, 4, 1)).problems(SPEC, 8) == []
    assert "pp4[1,4,4,1]" in ParallelConfig(pp=4, dp=1, stages=(1, 4, 4, 1)).describe()
    (why,) = ParallelConfig(pp=4, dp=1, stages=(1, 4, 4)).problems(SPEC, 8)
    assert "stated stages [1, 4, 4]" in why and "10 layers" in why
    (why,) = ParallelConfig(pp=4, dp=1, vp=2).problems(SPEC, 8)
    assert "without interleaving" in why
    (why,) = ParallelConfig(pp=16, dp=1, micro_batch=2).problems(SPEC, 16)
    assert "cannot fill pp 16" in why


def test_stated_uneven_stages_interleave_as_megatron_splits_llama_405b():
    """Megatron-Bridge's Llama 3.1 405B: 126 layers on pp 8 x vp 8, the embedding and the loss counted as a layer
    each, so the first and last stages hold 15 and the others 16; stated, it is a layout; unstated, it is not."""
    spec = TransformerSpec(layers=126, hidden=1024, heads=8, vocab=1000, seq_len=128, global_batch=64)
    stated = ParallelConfig(pp=8, dp=1, vp=8, stages=(15,) + (16,) * 6 + (15,))
    assert stated.problems(spec, 8) == []
    (why,) = ParallelConfig(pp=8, dp=1, vp=8).problems(spec, 8)
    assert "state them to interleave" in why
    (why,) = ParallelConfig(pp=4, dp=1, vp=4, stages=(3, 3, 2, 2)).problems(SPEC, 8)
    assert "cannot each give vp 4 chunks a layer" in why
