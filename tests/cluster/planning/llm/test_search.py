"""The layout search: factorisations, memory rejections with their reason, and GPT-3 175B on 1024 A100 80 GB."""

from __future__ import annotations

from dataclasses import replace

from cocoweave.cluster.catalog import load_catalog
from cocoweave.cluster.planning.llm.published import published_runs
from cocoweave.cluster.planning.llm.search import layouts, search
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.step import predict_step
from cocoweave.cluster.planning.llm.system import DEFAULT_STACK, STACKS, system_for

CATALOG = load_catalog()
A100 = system_for({m.name: m for m in CATALOG.machines}["dgx-a100-80gb"], CATALOG, STACKS[DEFAULT_STACK].eff)


def test_layouts_factor_n_with_tp_inside_a_node():
    spec = TransformerSpec(layers=4, hidden=64, heads=4, vocab=10, seq_len=8, global_batch=16)
    found = list(layouts(spec, 16, 8, STACKS[DEFAULT_STACK]))
    assert {c.gpus for c in found} == {16}
    assert max(c.tp for c in found) == 4  # 4 heads: tp 8 would split none
    assert {(c.tp, c.pp, c.dp) for c in found} >= {(1, 1, 16), (2, 2, 4), (4, 4, 1), (1, 4, 4)}
    assert all(c.tp <= 8 for c in found)


def test_nothing_fits_says_why():
    big = TransformerSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048, global_batch=64)
    result = search(big, A100, 8, STACKS[DEFAULT_STACK])
    assert result.best is None
    assert "needs" in result.smallest_rejection.rejected and "of 80 GB" in result.smallest_rejection.rejected


def test_gpt3_on_1024_a100_beats_or_equals_the_published_layout():
    gpt3 = next(r for r in published_runs() if r.name.startswith("SC'21 GPT-3"))
    stack = STACKS[DEFAULT_STACK]
    result = search(gpt3.spec, A100, 1024, stack)
    published = predict_step(gpt3.spec, replace(gpt3.cfg, dp_overlap=stack.dp_overlap), A100)
    assert result.best.step.total_s <= published.total_s
    assert result.best.memory.total <= 80e9


def test_long_sequences_are_searched_with_context_parallelism_and_their_memory():
    """Llama 3 8B at 128K tokens on 64 H100s: without context parallelism no layout fits (activations of 128K
    tokens); the search finds one with cp > 1 and says its memory."""
    from cocoweave.cluster.planning.llm.system import STACKS as ALL

    stack = ALL["megatron-core-2024"]
    h100 = system_for({m.name: m for m in CATALOG.machines}["dgx-h100"], CATALOG, stack)
    spec = TransformerSpec(name="Llama 3 8B 128K", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                           gated_mlp=True, vocab=128256, seq_len=131072, global_batch=64)
    result = search(spec, h100, 64, stack)
    assert result.best is not None and result.best.cfg.cp > 1
    assert result.best.memory.total <= 80e9 and result.best.step.cp_comm_s >= 0
    fixed = search(spec.model_copy(update={"context_parallel": 1}), h100, 64, stack)
    assert fixed.best is None or fixed.best.step.total_s > result.best.step.total_s


def test_an_moe_search_tries_the_expert_parallel_degrees():
    spec = TransformerSpec(layers=4, hidden=512, heads=8, vocab=32000, seq_len=1024, global_batch=64, experts=8,
                           experts_per_token=2)
    eps = {cfg.ep for cfg in layouts(spec, 16, 8, STACKS[DEFAULT_STACK])}
    assert eps == {1, 2, 4, 8}
    assert {cfg.ep for cfg in layouts(spec.model_copy(update={"expert_parallel": 2}), 16, 8,
                                      STACKS[DEFAULT_STACK])} == {2}
