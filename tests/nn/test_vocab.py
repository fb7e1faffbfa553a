"""The vocab-parallel embedding and cross-entropy compute what the single-process nn.Embedding and F.cross_entropy
compute, forward and backward, at tp 1, 2 and 4, on the hand-written path and as programs (every schedule of their
programs equals the program as written); no rank allocates a tensor as wide as the vocabulary in the loss; bad
configurations and inputs are refused with a sentence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cocoweave.equivalence.check import check_schedules
from cocoweave.errors import ParallelConfigError
from cocoweave.nn import ColumnParallelLinear
from cocoweave.nn import init as nn_init
from cocoweave.nn import vocab_programs as VP
from cocoweave.nn.compiled import schedules
from cocoweave.nn.functional import part
from cocoweave.nn.vocab import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    full_embedding_weight,
    partitioned_normal_,
    vocab_parallel_cross_entropy,
)
from cocoweave.sharding import is_dtensor, local

TOL = 1e-5
V, D = 16, 6  # vocabulary and embedding width of the cases (16 splits over 1, 2 and 4 ranks)


def _ids(tokens: int = 10, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (2, tokens // 2), generator=g)


# -- initialisation ----------------------------------------------------------------------------------------------


def test_the_weight_is_normal_and_every_block_has_the_whole_weights_values(monkeypatch):
    w = full_embedding_weight(1000, 64, seed=1)
    assert abs(w.mean()) < 0.01 and abs(w.std() - 1.0) < 0.01  # nn.Embedding's normal(0, 1), 64000 draws
    assert abs((w.abs() < 1).float().mean() - 0.6827) < 0.01  # and normal's shape, not another unit-variance one
    assert not torch.equal(w, full_embedding_weight(1000, 64, seed=2))
    monkeypatch.setattr(nn_init, "TILE", 5)  # small tiles: small tensors span several
    whole = full_embedding_weight(23, 7, seed=3)
    for tp in (2, 3, 4):
        rows = torch.tensor_split(torch.arange(23), tp)
        parts = [partitioned_normal_(torch.empty(len(r), 7), (23, 7), (int(r[0]), 0), 3) for r in rows]
        assert torch.equal(torch.cat(parts), whole)
    padded = full_embedding_weight(23, 7, seed=3, padding_idx=4)
    assert not padded[4].any() and torch.equal(padded[5], whole[5])


def test_a_single_process_layer_is_nn_embedding_with_the_whole_weight():
    emb = VocabParallelEmbedding(V, D, seed=7, padding_idx=3)
    ref = nn.Embedding(V, D, padding_idx=3)
    with torch.no_grad():
        ref.weight.copy_(full_embedding_weight(V, D, 7, padding_idx=3))
    assert torch.equal(emb.weight, ref.weight) and not is_dtensor(emb.weight)
    ids = _ids()
    y, y_ref = emb(ids), ref(ids)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.allclose(emb.weight.grad, ref.weight.grad, atol=TOL) and not emb.weight.grad[3].any()
    meta = VocabParallelEmbedding(V, D, seed=7, padding_idx=3, device="meta").to_empty(device="cpu")
    meta.reset_parameters()
    assert torch.equal(meta.weight, emb.weight)


# -- the DSL programs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("program", [
    VP.embedding_forward(5, 4), VP.embedding_forward(5, 4, sp=True), VP.embedding_backward(5, 4),
    VP.embedding_backward(5, 4, sp=True), VP.cross_entropy_forward(5, 8),
    VP.cross_entropy_forward(3, 8, smoothing=True), VP.cross_entropy_backward(5, 8),
    VP.cross_entropy_backward(5, 8, smoothing=0.1),
], ids=lambda p: p.name)
def test_every_schedule_of_a_vocab_program_equals_the_program(program):
    for world_size in (2, 4):
        rows = check_schedules(program, schedules(program), world_size, seed=world_size)
        bad = [(r.schedule, r.max_abs, r.error) for r in rows if not r.ok]
        assert not bad, f"{program}\n{bad}"


# -- the embedding on live ranks ---------------------------------------------------------------------------------


def embedding_case(rank: int, world_size: int, schedule: str | None, sp: bool,
                   padding_idx: int | None) -> dict[str, float]:
    """VocabParallelEmbedding built from a seed against nn.Embedding holding full_embedding_weight: the weight part,
    the output (with `sp` this rank's token slice) and the weight gradient's part; the gradient is a DTensor's."""
    ref = nn.Embedding(V, D, padding_idx=padding_idx)
    with torch.no_grad():
        ref.weight.copy_(full_embedding_weight(V, D, 11, padding_idx))
    emb = VocabParallelEmbedding(V, D, seed=11, padding_idx=padding_idx, schedule=schedule, sequence_parallel=sp)
    ids = _ids(tokens=10)  # 10 tokens: an uneven split over 4 ranks under sequence parallelism
    if padding_idx is not None:
        ids[0, :2] = padding_idx
    y_ref = ref(ids)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(2))
    (y_ref * g).sum().backward()
    y = emb(ids)
    want, g_mine = y_ref.detach(), g
    if sp:
        want, g_mine = part(want.reshape(-1, D), 0, world_size, rank), part(g.reshape(-1, D), 0, world_size, rank)
    (y * g_mine).sum().backward()
    return {"weight": (local(emb.weight) - part(ref.weight.detach(), 0, world_size, rank)).abs().max().item(),
            "out": (y - want).abs().max().item(),
            "grad": (local(emb.weight.grad) - part(ref.weight.grad, 0, world_size, rank)).abs().max().item(),
            "dtensor": float(is_dtensor(emb.weight) and is_dtensor(emb.weight.grad)),
            "repr_ok": float(("as written" in repr(emb)) == (schedule is None and not sp))}


def _assert_close(per_rank: list[dict[str, float]], what: str, dtensor: bool = True) -> None:
    for r, errs in enumerate(per_rank):
        bad = {k: v for k, v in errs.items() if k not in ("dtensor", "repr_ok") and not v <= TOL}
        assert not bad, f"{what}, rank {r}: {bad}"
        assert errs.get("dtensor", 1.0) == float(dtensor), f"{what}, rank {r}: the weight is not a DTensor Shard(0)"
        assert errs.get("repr_ok", 1.0) == 1.0, f"{what}, rank {r}: print(layer) does not show its schedule"


@pytest.mark.parametrize("schedule,sp", [(None, False), ("auto", False), ("auto", True)])
def test_the_embedding_equals_nn_embedding(local_world, world4, schedule, sp):
    _assert_close([embedding_case(0, 1, schedule, sp, 3)], f"tp 1 {schedule} sp={sp}", dtensor=False)
    _assert_close(local_world(2).run(embedding_case, schedule, sp, 3), f"tp 2 {schedule} sp={sp}")
    _assert_close(world4.run(embedding_case, schedule, sp, 13), f"tp 4 {schedule} sp={sp}")


def state_case(rank: int, world_size: int) -> dict[str, float]:
    """load_state_dict of a whole nn.Embedding's state dict, from_embedding, and this layer's own state dict."""
    torch.manual_seed(0)  # the same whole embedding on every rank
    ref = nn.Embedding(V, D, padding_idx=5)
    emb = VocabParallelEmbedding(V, D, seed=1)
    emb.load_state_dict(ref.state_dict())
    mine = part(ref.weight.detach(), 0, world_size, rank)
    other = VocabParallelEmbedding.from_embedding(ref)
    again = VocabParallelEmbedding(V, D, seed=2)
    again.load_state_dict(emb.state_dict())
    ids = _ids()
    return {"loaded": (local(emb.weight) - mine).abs().max().item(),
            "from_embedding": (local(other.weight) - mine).abs().max().item(),
            "round_trip": (local(again.weight) - mine).abs().max().item(),
            "forward": (other(ids) - ref(ids)).abs().max().item(),
            "dtensor": float(is_dtensor(emb.state_dict()["weight"]) and other.padding_idx == 5)}


def test_the_embedding_loads_a_whole_weight_and_its_own_state_dict(local_world):
    _assert_close([state_case(0, 1)], "tp 1", dtensor=False)
    _assert_close(local_world(2).run(state_case), "tp 2")


# -- the cross-entropy on live ranks -----------------------------------------------------------------------------


def _logits_and_target(tokens: int, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens * 31 + vocab)
    logits = torch.randn(2, tokens // 2, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    target[0, 1] = target[1, -1] = ignore_index
    return logits, target


def loss_case(rank: int, world_size: int, schedule: str | None, reduction: str, smoothing: float,
              ignore_index: int = -100, vocab: int = V, tokens: int = 12) -> dict[str, float]:
    """vocab_parallel_cross_entropy of this rank's part of the logits against F.cross_entropy of the whole: the
    loss and this rank's part of the logits' gradient."""
    logits, target = _logits_and_target(tokens, vocab, ignore_index)
    whole = logits.clone().requires_grad_(True)
    want = F.cross_entropy(whole.reshape(-1, vocab), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=smoothing)
    g = torch.rand(want.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    (want * g).sum().backward()
    mine = part(logits, -1, world_size, rank).clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(mine, target, ignore_index=ignore_index, reduction=reduction,
                                       label_smoothing=smoothing, schedule=schedule, vocab_size=vocab)
    (got.reshape(want.shape) * g).sum().backward()
    return {"loss": (got.reshape(want.shape) - want.detach()).abs().max().item(),
            "grad": (mine.grad - part(whole.grad, -1, world_size, rank)).abs().max().item()}


LOSS_CASES = [(None, "mean", 0.0), ("auto", "mean", 0.0), ("auto", "sum", 0.1), ("auto", "none", 0.0),
              (None, "none", 0.2)]


@pytest.mark.parametrize("schedule,reduction,smoothing", LOSS_CASES)
def test_the_loss_equals_torch_cross_entropy(local_world, world4, schedule, reduction, smoothing):
    _assert_close([loss_case(0, 1, schedule, reduction, smoothing)], f"tp 1 {schedule} {reduction} {smoothing}")
    _assert_close(local_world(2).run(loss_case, schedule, reduction, smoothing), f"tp 2 {schedule} {reduction}")
    _assert_close(world4.run(loss_case, schedule, reduction, smoothing), f"tp 4 {schedule} {reduction}")


def test_the_loss_takes_uneven_parts_with_vocab_size_and_an_ignore_index_inside_the_vocabulary(world4):
    # 18 classes over 4 ranks: parts of 5, 5, 4, 4; class 0 ignored
    _assert_close(world4.run(loss_case, "auto", "mean", 0.0, 0, 18), "uneven, programs")
    _assert_close(world4.run(loss_case, None, "mean", 0.1, 0, 18), "uneven, as written")


# -- never the whole vocabulary on a rank ------------------------------------------------------------------------


def widest_case(rank: int, world_size: int, schedule: str | None, gather_first: bool) -> dict[str, int]:
    """The widest and largest tensor any torch op creates on this rank during the loss's forward and backward
    (every op's outputs, seen by a TorchDispatchMode: the programs' generated code, collectives and autograd
    included). `gather_first`: the loss as a user without it writes it (all-gather the logits, F.cross_entropy),
    to show the measure sees a whole-vocabulary tensor when there is one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cocoweave.nn import gather_from_parallel

    vocab, tokens = 64, 8
    logits, target = _logits_and_target(tokens, vocab, -100)
    mine = part(logits, -1, world_size, rank).clone().requires_grad_(True)
    seen = {"last_dim": 0, "numel": 0}

    class Widest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, tuple | list) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim():
                    seen["last_dim"] = max(seen["last_dim"], t.shape[-1])
                    seen["numel"] = max(seen["numel"], t.numel())
            return out

    def step() -> None:
        if gather_first:
            whole = gather_from_parallel(mine, -1)
            loss = F.cross_entropy(whole.reshape(-1, vocab), target.reshape(-1))
        else:
            loss = vocab_parallel_cross_entropy(mine, target, schedule=schedule)
        loss.backward()

    step()  # the first call compiles (and with "auto" measures) the programs: outside the measure
    mine.grad = None
    with Widest():
        step()
    return {**seen, "part": vocab // world_size, "part_numel": tokens * vocab // world_size}


@pytest.mark.parametrize("schedule", [None, "auto"])
def test_the_loss_never_holds_more_than_its_part_of_the_logits(local_world, world4, schedule):
    """The issue's Done-when: vocab-parallel cross-entropy holds 1/tp of the logits per rank (asserted)."""
    for world in (local_world(2), world4):
        for r, seen in enumerate(world.run(widest_case, schedule, False)):
            assert seen["last_dim"] <= seen["part"] and seen["numel"] <= seen["part_numel"], (schedule, r, seen)
        for seen in world.run(widest_case, schedule, True):  # the measure sees the gathered logits
            assert seen["last_dim"] == seen["part"] * world.world_size, seen


# -- a tiny language model ---------------------------------------------------------------------------------------


def lm_case(rank: int, world_size: int, schedule: str | None) -> dict[str, float]:
    """VocabParallelEmbedding -> tanh -> ColumnParallelLinear(gather_output=False) -> vocab_parallel_cross_entropy
    against the same model in one process (nn.Embedding, nn.Linear, F.cross_entropy): loss and every gradient."""
    vocab, d = 32, 8
    torch.manual_seed(0)  # the same whole model on every rank
    emb_ref = nn.Embedding(vocab, d)
    head_ref = nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        emb_ref.weight.copy_(full_embedding_weight(vocab, d, 4))
    ids = _ids(12, vocab)
    target = ids.roll(-1, 1)
    target[:, -1] = -100
    want = F.cross_entropy(head_ref(torch.tanh(emb_ref(ids))).reshape(-1, vocab), target.reshape(-1))
    want.backward()
    emb = VocabParallelEmbedding(vocab, d, seed=4, schedule=schedule)
    head = ColumnParallelLinear.from_linear(head_ref, schedule=schedule)
    got = vocab_parallel_cross_entropy(head(torch.tanh(emb(ids))), target, schedule=schedule)
    got.backward()
    return {"loss": abs(got.item() - want.item()),
            "emb.grad": (local(emb.weight.grad) - part(emb_ref.weight.grad, 0, world_size, rank)).abs().max().item(),
            "head.grad": (local(head.weight.grad) - part(head_ref.weight.grad, 0, world_size, rank)).abs().max().item()}


@pytest.mark.parametrize("schedule", [None, "auto"])
def test_a_tiny_language_model_equals_the_single_process_one(local_world, schedule):
    _assert_close(local_world(2).run(lm_case, schedule), f"tiny LM, {schedule}")


# -- refusals ----------------------------------------------------------------------------------------------------


def test_bad_single_process_inputs_get_a_sentence():
    with pytest.raises(ParallelConfigError, match="num_embeddings must be a positive int"):
        VocabParallelEmbedding(0, 4)
    with pytest.raises(ParallelConfigError, match="padding_idx 9 is outside the vocabulary of 8"):
        VocabParallelEmbedding(8, 4, padding_idx=9)
    with pytest.raises(ParallelConfigError, match="schedule must be"):
        VocabParallelEmbedding(8, 4, schedule=3)
    emb = VocabParallelEmbedding(8, 4)
    with pytest.raises(ParallelConfigError, match="token id 8 is outside the vocabulary \\[0, 8\\)"):
        emb(torch.tensor([1, 8]))
    with pytest.raises(ParallelConfigError, match="token id -1 is outside"):
        emb(torch.tensor([-1, 2]))
    with pytest.raises(ParallelConfigError, match="integer tensor"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ParallelConfigError, match="has shape \\[4, 4\\]"):
        emb.load_state_dict({"weight": torch.zeros(4, 4)})
    with pytest.raises(ParallelConfigError, match="with max_norm cannot be split"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(8, 4, max_norm=1.0))
    logits, target = torch.randn(3, 8), torch.tensor([1, 2, 3])
    with pytest.raises(ParallelConfigError, match="target: token id 8 is outside the vocabulary"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 8, -100]))
    with pytest.raises(ParallelConfigError, match="target has shape \\[2\\], the logits \\[3, 8\\] need \\[3\\]"):
        vocab_parallel_cross_entropy(logits, target[:2])
    with pytest.raises(ParallelConfigError, match="reduction must be one of"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ParallelConfigError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(logits, target, label_smoothing=1.5)
    with pytest.raises(ParallelConfigError, match="class indices"):
        vocab_parallel_cross_entropy(logits, target.float())
    with pytest.raises(ParallelConfigError, match="have 8 classes on rank 0, its part of a vocabulary of 9"):
        vocab_parallel_cross_entropy(logits, target, vocab_size=9)
    loss = VocabParallelCrossEntropy(reduction="sum")(logits, target)
    assert torch.allclose(loss, F.cross_entropy(logits, target, reduction="sum"), atol=TOL)


def refusal_case(rank: int, world_size: int, what: str) -> str:
    """The sentence every rank raises for `what` (an empty string if nothing was raised)."""
    try:
        if what == "uneven vocabulary":
            VocabParallelEmbedding(10, 4)
        elif what == "uneven logits":
            vocab_parallel_cross_entropy(torch.randn(3, 3 - rank % 2), torch.tensor([0, 1, 2]))
    except ParallelConfigError as e:
        return str(e)
    return ""


def test_bad_configurations_are_refused_on_every_rank(world4):
    for msg in world4.run(refusal_case, "uneven vocabulary"):
        assert "a vocabulary of 10 does not split evenly over 4 ranks" in msg, msg
    for msg in world4.run(refusal_case, "uneven logits"):  # every rank refuses together: no rank left waiting
        assert "logits have between 2 and 3 classes; pass vocab_size=" in msg, msg
