"""The time and cost of a job under a resize plan follow from its step times and its batch policy: restarts,
checkpoints, the steps a revocation loses, and the progress a step makes (moved here from tests/test_elastic.py
with the model)."""

from __future__ import annotations

import pytest

from cocoweave.cluster.planning.resize import Resize, parse_resize_plan, predict_resizes, progress_per_step
from cocoweave.elastic import BatchPolicy
from cocoweave.errors import ElasticError

SPOT = [Resize(8, 0.1), Resize(4, 0.1), Resize(8)]  # spot capacity 8 -> 4 -> 8: 360 s, 360 s, then until done


def test_keep_global_through_8_4_8_pays_each_restart_and_runs_the_rest_at_8():
    pred = predict_resizes(BatchPolicy.keep_global(64), 1000, {8: 1.0, 4: 1.8}, SPOT, price_per_rank_hour=2.0,
                           restart_s=60.0)
    # 8 ranks: (360 - 60) / 1.0 = 300 steps; 4 ranks: 300 / 1.8 = 166; 8 ranks: the 534 left, in 60 + 534 s
    assert [(p.world, p.steps, p.kept) for p in pred.phases] == [(8, 300, 300), (4, 166, 166), (8, 534, 534)]
    assert pred.finished and pred.steps == 1000 and pred.lost_steps == 0 and pred.progress == 1000
    assert pred.hours == pytest.approx((360 + 360 + 594) / 3600)
    assert pred.cost == pytest.approx(2.0 * (8 * 0.1 + 4 * 0.1 + 8 * 594 / 3600))


def test_scale_makes_less_progress_per_step_on_fewer_ranks_and_more_on_more():
    linear, sqrt = BatchPolicy.scale(64, 8, "linear"), BatchPolicy.scale(64, 8, "sqrt")
    assert progress_per_step(linear, 4) == 0.5 and progress_per_step(linear, 16) == 2.0
    assert progress_per_step(sqrt, 4) == 0.5  # the rule sets the learning rate, not the samples a step takes
    pred = predict_resizes(linear, 1000, {8: 1.0, 4: 1.0}, SPOT, price_per_rank_hour=1.0, restart_s=60.0)
    # 300 steps (300 base steps), 300 steps at half a base step (150), then 550 steps at 8
    assert [(p.steps, p.progress) for p in pred.phases] == [(300, 300.0), (300, 150.0), (550, 550.0)]
    assert pred.hours == pytest.approx((360 + 360 + 610) / 3600)


def test_adascale_progress_is_its_expected_gain_for_the_noise_scale():
    ada = BatchPolicy.scale(64, 8, "adascale")
    assert progress_per_step(ada, 16, noise_scale=0.0) == 1.0  # no noise: a bigger batch gains nothing
    assert progress_per_step(ada, 16, noise_scale=1e12) == pytest.approx(2.0)  # all noise: the batch ratio
    assert progress_per_step(ada, 16, noise_scale=64.0) == pytest.approx((1 + 1) / (1 + 0.5))
    with pytest.raises(ElasticError, match="needs the gradient noise scale"):
        progress_per_step(ada, 16)


def test_a_revocation_loses_the_steps_after_the_last_checkpoint():
    pred = predict_resizes(BatchPolicy.keep_global(64), 1000, {8: 1.0, 4: 1.8}, SPOT, price_per_rank_hour=1.0,
                           restart_s=60.0, checkpoint_every=100, checkpoint_s=10.0)
    first = pred.phases[0]  # 60 + 280 steps + 2 checkpoints = 360 s; the 80 steps after step 200 are lost
    assert (first.steps, first.kept) == (280, 200)
    assert pred.finished and pred.lost_steps > 0 and pred.steps == 1000 + pred.lost_steps


def test_a_phase_without_ranks_waits_for_free_and_an_endless_one_never_finishes():
    pred = predict_resizes(BatchPolicy.keep_global(8), 100, {2: 1.0}, [Resize(2, 0.01), Resize(0, 1.0), Resize(2)],
                           price_per_rank_hour=1.0, restart_s=0.0)
    assert [p.world for p in pred.phases] == [2, 0, 2] and pred.phases[1].cost == 0.0
    assert pred.finished and pred.hours == pytest.approx(1.0 + 100 / 3600)
    stuck = predict_resizes(BatchPolicy.keep_global(8), 100, {2: 1.0}, [Resize(2, 0.01), Resize(0)], 1.0,
                            restart_s=0.0)
    assert not stuck.finished and stuck.progress == 36


def test_resize_plans_parse_and_bad_ones_are_one_sentence():
    assert parse_resize_plan("8:2, 4:1.5,0:0.5,8") == [Resize(8, 2.0), Resize(4, 1.5), Resize(0, 0.5), Resize(8)]
    for text, message in [("8:x", "must look like RANKS:HOURS"), ("-1:2", "at least 0"), ("8:0", "positive"),
                          ("8,4:1", "only the last item"), ("8:inf", "finite")]:
        with pytest.raises(ElasticError, match=message):
            parse_resize_plan(text)
    with pytest.raises(ElasticError, match="no positive step time for 4 ranks .*known for 8"):
        predict_resizes(BatchPolicy.keep_global(8), 10, {8: 1.0}, SPOT, 1.0)


def test_bad_step_counts_are_one_sentence_and_the_model_is_importable_from_elastic_as_documented():
    for kwargs, message in [({"base_steps": 0}, "the job's base steps must be an integer of at least 1, got 0"),
                            ({"base_steps": True}, "base steps must be an integer"),
                            ({"base_steps": 10, "checkpoint_every": 0}, "the checkpoint interval must be an integer")]:
        with pytest.raises(ElasticError, match=message):
            predict_resizes(BatchPolicy.keep_global(8), step_time_s={8: 1.0}, resize_plan=SPOT, price_per_rank_hour=1.0,
                            **kwargs)
    from cocoweave import elastic

    assert (elastic.predict_resizes, elastic.parse_resize_plan, elastic.Resize) == (predict_resizes, parse_resize_plan,
                                                                                 Resize)


def test_the_old_name_parse_schedule_still_parses_with_a_deprecation_warning():
    from cocoweave import elastic

    with pytest.warns(DeprecationWarning, match="parse_resize_plan"):
        assert elastic.parse_schedule("8:2,4") == parse_resize_plan("8:2,4") == [Resize(8, 2.0), Resize(4)]
