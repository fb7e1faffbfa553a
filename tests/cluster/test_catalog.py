"""The catalog shipped with cocoweave: every machine's GPU and networks have cited spec-sheet figures, and
bad catalogs are refused with a sentence naming the entry."""

from __future__ import annotations

import pytest
import yaml

from cocoweave.cluster.catalog import DEFAULT_CATALOG, load_catalog, parse_catalog
from cocoweave.cluster.planning.llm.plan import plan_llm
from cocoweave.cluster.planning.llm.spec import TransformerSpec
from cocoweave.cluster.planning.llm.system import DEFAULT_STACK, STACKS
from cocoweave.cluster.planning.planner import plan_cluster
from cocoweave.cluster.profiling.run_profile import RunProfile
from cocoweave.errors import PlanningError


def test_the_default_catalog_covers_todays_gpus_with_sources():
    cat = load_catalog()
    assert {"H100", "H200", "A100-80GB", "L4"} <= set(cat.gpus)
    for gpu in cat.gpus.values():
        assert gpu.tflops["float32"] > 0 and gpu.hbm_gb_s > 0 and "(20" in gpu.source  # a year in the citation
    for net in cat.networks.values():
        assert net.bandwidth_gb_s > 0 and net.source
    for m in cat.machines:
        assert m.gpu in cat.gpus and (m.inter_node or m.intra_node)
        assert m.spot_per_hour is None or m.spot_per_hour < m.on_demand_per_hour
    h100 = next(m for m in cat.machines if m.gpu == "H100")
    assert h100.gpus_per_node == 8 and h100.nodes(9) == 2 and h100.nodes(8) == 1
    assert cat.gpus["H100"].peak_flops("bfloat16") > cat.gpus["H100"].peak_flops("float32")
    assert cat.gpus["K80"].peak_flops("bfloat16") == cat.gpus["K80"].peak_flops("float32")  # no bf16: float32's


def test_catalog_errors_name_the_entry():
    base = {"machines": [{"name": "m", "gpu": "X", "on_demand_per_hour": 1.0, "startup_s": 60,
                          "inter_node": "eth"}],
            "networks": {"eth": {"bandwidth_gb_s": 1.0, "latency_us": 10, "source": "s"}}}
    assert parse_catalog(base, "c.yaml").ps_per_hour is None  # no parameter server: fine for run profiles
    with pytest.raises(PlanningError, match=r"machines\[0\]: inter_node 'ib' is not one of the catalog's networks"):
        parse_catalog({**base, "machines": [{**base["machines"][0], "inter_node": "ib"}]}, "c.yaml")
    with pytest.raises(PlanningError, match=r"gpus\['X'\]: tflops needs a float32 entry"):
        parse_catalog({**base, "gpus": {"X": {"name": "x", "tflops": {"bfloat16": 1}, "hbm_gb_s": 1,
                                              "memory_gb": 1, "source": "s"}}}, "c.yaml")
    with pytest.raises(PlanningError, match="efficiency factors"):
        parse_catalog({**base, "efficiency": {"compute": 1.5}}, "c.yaml")


class FixedCheckpoint:
    """A checkpoint model of 30 s whatever the size (the LLM planner asks one for every GPU count)."""

    def duration_s(self, size_mb: float) -> float:
        return 30.0


def test_a_new_gpu_type_is_one_catalog_entry_and_both_planners_see_it(tmp_path, make_run):
    doc = yaml.safe_load(DEFAULT_CATALOG.read_text())  # the only place a GPU's figures are written
    doc["gpus"]["X1"] = {"name": "Test X1 96 GB", "tflops": {"float32": 200, "bfloat16": 2000}, "memory_gb": 96,
                         "hbm_gb_s": 8000, "source": "invented for this test (2026)"}
    doc["machines"].append({"name": "x1-8x", "gpu": "X1", "gpus_per_node": 8, "intra_node": "nvlink4",
                            "inter_node": "ib-ndr-400", "on_demand_per_hour": 60.0, "spot_per_hour": 20.0,
                            "revocations_per_hour": 0.05, "startup_s": 300})
    (tmp_path / "catalog.yaml").write_text(yaml.safe_dump(doc))
    cat = load_catalog(tmp_path / "catalog.yaml")
    # the planner of a profiled run (CM-DARE's time/cost model over MODELLED steps) prices the new machine
    runs = [make_run(p, 10.0 / p + 1.0, 10.0 / p, 1.0, 4e13 / p, {"all_reduce": (1.0, 4e6)}) for p in (1, 2, 4)]
    prof = RunProfile("train_x.py", [], [1, 2, 4], runs, {"cores": 4, "threads_per_rank": 1, "cpu": "test"})
    plan = plan_cluster(prof.workload(cat, [1, 8], checkpoint_s=4.0), cat, 1000, budget_usd=1e6)
    x1 = {o.workers: o for o in plan.options if o.machine.name == "x1-8x" and o.pricing == "on-demand"}
    h100 = {o.workers: o for o in plan.options if o.machine.name == "dgx-h100" and o.pricing == "on-demand"}
    assert set(x1) == {1, 8} and x1[1].step_time_s < h100[1].step_time_s  # its own figures: faster than an H100
    # the LLM planner lays a model out on it
    spec = TransformerSpec(name="tiny", layers=4, hidden=512, heads=8, vocab=32000, seq_len=1024, global_batch=64)
    llm = plan_llm(spec, cat, 1e10, STACKS[DEFAULT_STACK], FixedCheckpoint(), budget_usd=1e6, max_gpus=16)
    assert {n for (name, n) in llm.layouts if name == "x1-8x"} == {8, 16}
    assert any(o.machine.name == "x1-8x" for o in llm.plan.options)
