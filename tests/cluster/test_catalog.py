"""The catalog shipped with cocoweave: every machine's GPU and networks have cited spec-sheet figures, and
bad catalogs are refused with a sentence naming the entry."""

from __future__ import annotations

import pytest

from cocoweave.cluster.catalog import load_catalog, parse_catalog
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
