"""The CM-DARE loaders, one protocol and the PS-bottleneck analysis on the real published data."""

from __future__ import annotations

import pytest

from cocoweave.cluster.cmdare import tables as data
from cocoweave.cluster.cmdare.features import paper_speed_features, speed_features
from cocoweave.cluster.cmdare.ps_scaling import scaling_report
from cocoweave.cluster.cmdare.regression import linear_baseline, log_space_candidates, svr_baseline
from cocoweave.cluster.cmdare.reproduce import (
    OURS,
    PER_MODEL_MEAN,
    PUBLISHED,
    checkpoint_splits,
    compare,
    evaluate_splits,
    heldout_split,
    per_model_mean,
    random_splits,
    speed_splits,
)
from cocoweave.errors import CocoweaveError

try:
    DATA = data.find_data_dir()
except CocoweaveError:
    pytest.skip("CM-DARE data (shared/data/cmdare) not available", allow_module_level=True)

FAST = [c for c in log_space_candidates() if c.name in ("log ridge", "additive law")]


def per_gpu_paper(df):
    return paper_speed_features(df, agnostic=False)


def test_model_names_from_every_table_map_to_one_slug():
    assert {data.canonical_model(n) for n in ("ResNet-32", "Res32", "resnet32", "res32")} == {"res32"}
    assert data.canonical_model("Shake Large") == data.canonical_model("shakebig") == "shakebig"
    assert data.canonical_model("Custom ResNet 9") == "custom9"
    assert data.canonical_model("Shake 64 32d") == data.canonical_model("shake mid 32d") == "shakemid32d"


def test_loaders_give_complete_tidy_tables():
    speed = data.load_speed(DATA)
    assert len(speed) == 520 and speed["model"].nunique() == 20
    assert set(speed.groupby(["gpu", "model"]).size()) == {13}
    assert not speed_features(speed).isna().any().any()
    heldout = data.load_heldout_k80(DATA)
    assert set(heldout["model"]) == set(data.HELD_OUT_MODELS) and set(heldout["gpu"]) == {"K80"}
    ckpt = data.load_checkpoints(DATA)
    assert (len(ckpt["whole"]), len(ckpt["train"]), len(ckpt["test"])) == (100, 80, 20)
    assert not set(ckpt["train"]["model"]) & set(ckpt["test"]["model"])
    cluster = data.load_cluster_throughput(DATA)
    assert len(cluster) == 96 and set(cluster["workers"]) == set(range(1, 9))
    assert set(data.load_base_step_times(DATA)["gpu"]) == {"K80", "P100", "V100"}


def test_data_dir_errors_are_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(CocoweaveError, match="not a CM-DARE data folder"):
        data.find_data_dir(tmp_path)
    monkeypatch.setenv(data.DATA_ENV, str(DATA))
    assert data.find_data_dir() == DATA


def test_heldout_k80_models_are_predicted_within_5_percent_and_beat_linear():
    speed = data.load_speed(DATA)
    k80 = speed[speed["gpu"] == "K80"]
    split = heldout_split(k80[~k80["model"].isin(data.HELD_OUT_MODELS)], data.load_heldout_k80(DATA), "c",
                          "K80", speed_features, per_gpu_paper, "step_time_s", svr_baseline())
    scores = compare(split, FAST)
    assert scores[OURS][0] < 5.0
    assert scores[OURS][0] < scores["linear (paper)"][0]


def test_seed_0_is_the_papers_split_and_ours_beats_the_published_figures():
    speed = data.load_speed(DATA)
    for gpu in ("K80", "P100"):
        [split] = random_splits(speed[speed["gpu"] == gpu], "a", gpu, speed_features, per_gpu_paper,
                                "step_time_s", [0], True, svr_baseline())
        scores = compare(split, FAST)
        # the paper's linear regression on the paper's split gives the published figure
        assert scores["linear (paper)"][0] == pytest.approx(PUBLISHED[("a", gpu)]["linear (paper)"], abs=0.01)
        assert scores[OURS][0] < PUBLISHED[("a", gpu)]["SVR (paper)"]


def test_checkpoint_svr_reproduces_the_published_figure():
    [split] = checkpoint_splits(data.load_checkpoints(DATA), [0])[:1]
    scores = compare(split, [linear_baseline()])
    assert scores["SVR (paper)"][0] == pytest.approx(PUBLISHED[("d", "random split")]["SVR (paper)"], abs=0.01)


def test_ps_bottleneck_is_found_on_p100_with_one_ps_and_not_on_k80():
    report = scaling_report(data.load_cluster_throughput(DATA), data.load_speed(DATA))
    bt = report.bottlenecks
    p100 = bt[(bt["gpu"] == "P100") & (bt["ps"] == 1)]
    assert p100["bottleneck_workers"].notna().all() and p100["bottleneck_workers"].max() <= 6
    assert bt[bt["gpu"] == "K80"]["bottleneck_workers"].isna().all()
    assert report.law_mape["all"] < report.linear_mape["all"] / 2


def test_per_model_mean_is_the_noise_floor_of_random_splits():
    speed = data.load_speed(DATA)
    k80 = speed[speed["gpu"] == "K80"]
    [split] = random_splits(k80, "a", "K80", speed_features, per_gpu_paper, "step_time_s", [0], True, svr_baseline())
    scores = compare(split, FAST)
    assert scores[PER_MODEL_MEAN][0] == pytest.approx(0.74, abs=0.01)  # the figure the reproduction found
    assert scores[PER_MODEL_MEAN][0] < scores["SVR (paper)"][0]
    held = heldout_split(k80[~k80["model"].isin(data.HELD_OUT_MODELS)], data.load_heldout_k80(DATA), "c", "K80",
                         speed_features, per_gpu_paper, "step_time_s", svr_baseline())
    assert PER_MODEL_MEAN not in compare(held, FAST)  # unseen models have no repeats to average


def test_per_model_mean_falls_back_to_the_gpu_mean_for_an_unseen_model():
    import pandas as pd

    train = pd.DataFrame({"model": ["a", "a", "b"], "gpu": ["K80"] * 3, "t": [1.0, 3.0, 5.0]})
    test = pd.DataFrame({"model": ["a", "c"], "gpu": ["K80", "K80"], "t": [2.0, 3.0]})
    assert list(per_model_mean(train, test, "t")) == [2.0, 3.0]


def test_results_lead_with_the_held_out_protocols():
    speed = data.load_speed(DATA)
    splits = speed_splits(speed, data.load_heldout_k80(DATA), [0])
    results = evaluate_splits(splits, FAST)
    firsts = [(r.protocol, r.held_out) for r in results]
    n_held = sum(held for _, held in firsts)
    assert n_held and all(held for _, held in firsts[:n_held]) and firsts[0][0] == "c"
