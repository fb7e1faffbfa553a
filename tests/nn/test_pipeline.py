"""cocoweave.nn.Pipeline on live Gloo ranks: a model cut into pipeline stages (tensor-parallel inside, data-parallel
across with DistributedAdamW) under torch.distributed.pipelining's schedules computes the loss, every parameter's
gradient and every parameter after one AdamW step of one process running the whole batch, with the same dropout
masks; only 1/tp of each activation crosses a boundary."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cocoweave.errors import ParallelConfigError
from cocoweave.nn import ReferenceBlock, TransformerBlock, parallel_mesh
from cocoweave.nn.functional import group_rank, part
from cocoweave.nn.pipeline import Pipeline, stage_blocks
from cocoweave.optim import DistributedAdamW
from cocoweave.sharding import local

V, D, H, T, BLOCKS = 11, 16, 4, 8, 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(D), nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def reference() -> tuple[Embed, list[ReferenceBlock], Head]:
    torch.manual_seed(0)
    return Embed(), [ReferenceBlock(D, H, dropout=0.2, seed=10 + i) for i in range(BLOCKS)], Head()


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)


LR, EPS = 1e-2, 1e-3  # an eps above float noise: the key bias's gradient is zero up to rounding


def named(embed: nn.Module, blocks: list[nn.Module], head: nn.Module) -> dict[str, nn.Parameter]:
    params = {f"first.{k}": p for k, p in embed.named_parameters()}
    params |= {f"last.{k}": p for k, p in head.named_parameters()}
    return params | {f"block{i}.{k}": p for i, b in enumerate(blocks) for k, p in b.named_parameters()}


def reference_step(n: int, step: int) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole batch in one process: its loss, every parameter's gradient, every parameter after one AdamW step."""
    embed, blocks, head = reference()
    params = named(embed, blocks, head)
    x, y = batch(n)
    h = embed(x)
    for b in blocks:
        h = b(h, step=step)
    loss = ce(head(h), y)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in params.items()}
    torch.optim.AdamW(params.values(), lr=LR, eps=EPS).step()
    return loss.item(), grads, {k: p.detach() for k, p in params.items()}


def pipeline_case(rank: int, world_size: int, tp: int, pp: int, schedule: str, m: int, n: int,
                  sliced: bool = True, sp: bool = False) -> dict[str, object]:
    mesh = parallel_mesh(tensor_parallel=tp, pipeline_parallel=pp)
    tp_group = mesh.get_group("tp")
    embed, blocks, head = reference()

    def block(i: int) -> TransformerBlock:
        return TransformerBlock(D, H, dropout=0.2, group=tp_group, sequence_parallel=sp).load_reference(blocks[i])

    pipe = Pipeline(mesh, n_blocks=BLOCKS, block=block, first=lambda: embed, last=lambda: head, loss_fn=ce,
                    microbatches=m, pipeline_schedule=schedule, sliced=sliced, sequence_parallel=sp)
    dp, dp_rank = mesh.size(0), group_rank(mesh.get_group("dp"))
    x, y = batch(n)
    share = n // dp
    mine = slice(dp_rank * share, (dp_rank + 1) * share)
    opt = DistributedAdamW(list(pipe.parameters()), lr=LR, eps=EPS, process_group=mesh.get_group("dp"))
    opt.zero_grad()
    loss = pipe.step(x[mine], y[mine], step=3, positions=torch.arange(n)[mine], no_sync=opt.no_sync)
    grads, params = {}, {}
    for s, mod in zip(pipe.stage_ids, pipe.modules):
        blocks_of = list(stage_blocks(BLOCKS, pipe.num_stages, s))
        for k, p in mod.named_parameters():
            kind, _, rest = k.partition(".")
            if kind == "blocks":
                j, _, rest = rest.partition(".")
                k = f"block{blocks_of[int(j)]}.{rest}"
            grads[k], params[k] = local(p.grad).clone(), local(p)
            if dp > 1:  # the gradient the optimizer's step reduces to: the mean over the replicas
                dist.all_reduce(grads[k], group=mesh.get_group("dp"))
                grads[k] /= dp
    opt.step()
    return {"loss": loss, "grads": grads, "params": {k: p.detach().clone() for k, p in params.items()},
            "tp_rank": group_rank(tp_group), "dp": dp,
            "bytes": pipe.boundary_bytes(), "messages": pipe.boundary_messages()}


def check(results: list[dict[str, object]], n: int, tp: int) -> None:
    loss, ref_grads, ref_params = reference_step(n, 3)
    seen: set[str] = set()
    for r in results:
        assert abs(r["loss"] - loss) < 1e-5, (r["loss"], loss)
        for what, ref, tol in (("grads", ref_grads, 1e-5), ("params", ref_params, 1e-4)):
            for k, got in r[what].items():
                full = ref[k]
                dims = [d for d in range(full.dim()) if full.shape[d] != got.shape[d]]
                want = part(full, dims[0], tp, r["tp_rank"]) if dims else full
                assert (got - want).abs().max() < tol, (what, k)
                seen.add(k)
    assert seen == set(ref_grads)


@pytest.mark.parametrize("tp,pp,schedule,sp", [(2, 2, "1f1b", False), (2, 2, "gpipe", True), (1, 4, "gpipe", False),
                                               (1, 2, "interleaved1f1b", False), (1, 2, "loopedbfs", False)])
def test_pipeline_equals_one_process(world4, tp: int, pp: int, schedule: str, sp: bool) -> None:
    """pp 2 x tp 2 (with and without sequence parallelism), pp 4, and pp 2 x dp 2 (interleaved and looped BFS: two
    stages per rank) against the whole batch in one process."""
    check(world4.run(pipeline_case, tp, pp, schedule, 4, 8, sp=sp), 8, tp)


def test_only_a_slice_crosses_each_boundary(world4) -> None:
    """At tp 2 each rank of a stage sends half of the activation of each micro-batch; the full send sends all of it."""
    sliced = world4.run(pipeline_case, 2, 2, "gpipe", 2, 4)
    full = world4.run(pipeline_case, 2, 2, "gpipe", 2, 4, sliced=False)
    check(full, 4, 2)
    activation = 2 * T * D * 4  # a micro-batch of 2 samples, fp32
    for s, f in zip(sliced, full):
        if s["messages"]["forward"]:  # the first stage's ranks
            assert s["messages"]["forward"] == f["messages"]["forward"] == 2
            assert f["bytes"]["forward"] == 2 * activation
            assert s["bytes"]["forward"] == activation
    assert sum(s["bytes"]["backward"] for s in sliced) * 2 == sum(f["bytes"]["backward"] for f in full) > 0


def bad_case(rank: int, world_size: int, schedule: str, m: int, n: int) -> str:
    with pytest.raises(ParallelConfigError) as e:
        pipeline_case(rank, world_size, 2, 2, schedule, m, n)
    return str(e.value)


@pytest.mark.parametrize("schedule,m,n,said", [
    ("zigzag", 2, 4, "unknown pipeline schedule 'zigzag'"),
    ("1f1b", 1, 4, "needs at least as many micro-batches as pipeline ranks (2), got 1"),
    ("gpipe", 3, 4, "a batch of 4 samples cannot be split into 3 equal micro-batches"),
])
def test_a_layout_the_engine_cannot_run_is_one_sentence(world4, schedule: str, m: int, n: int, said: str) -> None:
    assert said in world4.run(bad_case, schedule, m, n)[0]


def test_a_mesh_without_the_pipeline_dims_is_one_sentence() -> None:
    with pytest.raises(ParallelConfigError, match="Pipeline needs a DeviceMesh with dims 'dp', 'pp' and 'tp'"):
        Pipeline(object(), n_blocks=2, block=lambda i: nn.Identity(), loss_fn=ce, microbatches=2)


def missing_case(rank: int, world_size: int) -> list[str]:
    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    pipe = Pipeline(mesh, n_blocks=2, block=lambda i: TransformerBlock(D, H, group=mesh.get_group("tp")),
                    first=Embed, last=Head, loss_fn=ce, microbatches=2)
    said = []
    for args in ((None, None), (None, batch(4)[1]) if pipe.has_first else (batch(4)[0], None)):
        with pytest.raises(ParallelConfigError) as e:
            pipe.step(*args)
        said.append(str(e.value))
    x, y = batch(4)
    with pytest.raises(ParallelConfigError) as e:
        pipe.step(x[:0], y[:0])
    said.append(str(e.value))
    return said


def test_a_step_without_its_batch_is_one_sentence(world4) -> None:
    for rank, said in enumerate(world4.run(missing_case)):
        assert said[2] == "Pipeline.step got an empty batch (shape (0, 8)): it needs at least 2 samples, one per " \
                          "micro-batch"
        assert "needs the batch's inputs, targets or positions" in said[0]
        assert said[1].endswith("the first stage and needs the batch's inputs" if rank < 2 else
                                "the last stage and needs the batch's targets")


def gloo_gpu_case(rank: int, world_size: int) -> str:
    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ParallelConfigError) as e:  # the meta device stands in for a GPU: refused before any use
        Pipeline(mesh, n_blocks=2, block=lambda i: nn.Identity(), loss_fn=ce, microbatches=2,
                 device=torch.device("meta"))
    return str(e.value)


def test_a_pipeline_on_gpus_over_gloo_is_one_sentence(world4) -> None:
    """torch's engine would hand CUDA tensors to Gloo's send, which fails deep inside with 'Bad address'."""
    assert "needs NCCL between stages" in world4.run(gloo_gpu_case)[0]


def renamed_case(rank: int, world_size: int) -> tuple[str, str, bool, str]:
    import warnings

    mesh = parallel_mesh(tensor_parallel=2, pipeline_parallel=2)
    make = dict(n_blocks=2, block=lambda i: TransformerBlock(D, H, group=mesh.get_group("tp")), first=Embed,
                last=Head, loss_fn=ce, microbatches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new names warn about nothing
        new = Pipeline(mesh, pipeline_schedule="gpipe", **make)
        assert (new.pipeline_schedule_name, type(new.pipeline_schedule).__name__) == ("gpipe", "ScheduleGPipe")
    with pytest.warns(DeprecationWarning, match=r"Pipeline\(pipeline_schedule=\.\.\.\)"):
        pipe = Pipeline(mesh, schedule="gpipe", **make)
    with pytest.warns(DeprecationWarning, match="Pipeline.pipeline_schedule "):
        engine = pipe.schedule
    with pytest.warns(DeprecationWarning, match="Pipeline.pipeline_schedule_name"):
        name = pipe.schedule_name
    with pytest.raises(ParallelConfigError, match="give pipeline_schedule= only"):
        Pipeline(mesh, schedule="gpipe", pipeline_schedule="interleaved1f1b", **make)
    return pipe.pipeline_schedule_name, type(pipe.pipeline_schedule).__name__, engine is pipe.pipeline_schedule, name


def test_the_old_schedule_keyword_and_attributes_still_work_for_one_release_with_a_warning(world4) -> None:
    """Pipeline(schedule=) is Pipeline(pipeline_schedule=) (a schedule in cocoweave is a CoCoNet Schedule): the old
    keyword builds the schedule it names, and .schedule / .schedule_name read the renamed attributes, each warning."""
    assert world4.run(renamed_case) == [("gpipe", "ScheduleGPipe", True, "gpipe")] * 4
