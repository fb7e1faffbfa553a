"""The host scaling model: it recovers a known model from three worlds and predicts the fourth, splits the
step into compute, communication and core sharing (even and uneven spreads of ranks over the cores), and names the
bottleneck in a sentence."""

from __future__ import annotations

import dataclasses

import pytest

from cocoweave.cluster.profiling.host_scaling import (
    HostScaling,
    ScalingFitError,
    Traffic,
    bottleneck,
    fit_host_scaling,
    imbalance,
    measured_parts,
    work_share_fit,
)

GRADIENTS = {"all_reduce": (1.0, 2e6)}  # one all-reduce of 2 MB of gradients per step


def truth(cores: int = 2, mu: float = 0.6, strong: bool = True) -> HostScaling:
    """A known model, continuous at the cores: eta_bal is its step at K ranks over a rank's CPU time there."""
    flops0, flops1 = (0.0, 4e9) if strong else (4e9, 0.0)
    model = HostScaling(cores, a_ms=5.0, b_ms=40.0, flops0=flops0, flops1=flops1, gamma_ms_per_mb=2.0,
                        delta_ms_per_hop=0.1, omega_ms_per_hop=0.5, eta_bal=1.0, traffic=Traffic(GRADIENTS),
                        reference_flops=4e9, mu=mu)
    return dataclasses.replace(model, eta_bal=model.predict(cores).total_ms / model.busy_ms(cores))


def measured(model: HostScaling, p: int, make_run):
    parts = model.predict(p)
    return make_run(p, parts.total_ms, parts.compute_ms, parts.comm_cpu_ms, model.flops0 + model.flops1 / p,
                    GRADIENTS)


@pytest.mark.parametrize("strong", [True, False])
def test_fit_on_three_worlds_predicts_the_fourth(make_run, strong):
    model = truth(strong=strong)
    fitted = fit_host_scaling([measured(model, p, make_run) for p in (1, 2, 3)], cores=2)
    if strong:  # with a batch per rank, only a + b (the constant compute) is identifiable
        assert fitted.a_ms == pytest.approx(5.0, rel=1e-6) and fitted.b_ms == pytest.approx(40.0, rel=1e-6)
    assert fitted.eta_bal == pytest.approx(model.eta_bal, rel=1e-6) and fitted.mu == pytest.approx(0.6, rel=1e-6)
    assert fitted.shared_cpu == pytest.approx(1.0, rel=1e-6)
    for p in (4, 5, 6, 8):
        assert fitted.predict(p).total_ms == pytest.approx(model.predict(p).total_ms, rel=1e-6)


def test_work_share_follows_the_counted_flops():
    assert work_share_fit([1, 2, 4], [8e9, 4e9, 2e9]) == pytest.approx((0.0, 8e9), abs=1.0)  # a split global batch
    assert work_share_fit([1, 2, 4], [8e9, 8e9, 8e9]) == pytest.approx((8e9, 0.0), abs=1.0)  # a batch per rank


def test_oversubscribed_cores_make_the_step_core_bound():
    model = truth(cores=2)
    alone = model.predict(2)
    shared = model.predict(4)
    assert alone.contention_ms == 0.0
    assert shared.total_ms == pytest.approx(model.eta_bal * 4 * (shared.compute_ms + shared.comm_cpu_ms) / 2)
    sentence = bottleneck([model.predict(p) for p in (1, 2, 3, 4)], 2)
    assert sentence.startswith("core-bound from 3 ranks: 3 ranks share 2 cores")


def test_communication_bottleneck_names_the_collective():
    model = HostScaling(64, 1.0, 1.0, 0.0, 1.0, 10.0, 0.0, 0.0, 1.0,
                        Traffic({"reduce_scatter": (1.0, 6e6), "all_gather": (1.0, 2e6)}), 1.0)
    sentence = bottleneck([model.predict(p) for p in (1, 2, 4)], 64)
    assert sentence.startswith("communication-bound from 2 ranks: the reduce-scatter is ")
    assert bottleneck([truth(cores=64).predict(1)], 64).startswith("compute-bound up to 1 rank:")


def test_traffic_moves_the_ring_fractions():
    t = Traffic({"all_reduce": (2.0, 1e6), "all_gather": (1.0, 3e6)})
    assert t.megabytes(4) == pytest.approx(2 * 3 / 4 * 1 + 3 / 4 * 3)
    assert t.hops(4) == 2 * 2 * 3 + 3
    assert t.megabytes(1) == 0 and t.hops(1) == 0


def test_too_few_worlds_is_one_sentence(make_run):
    with pytest.raises(ScalingFitError, match="at least two world sizes"):
        fit_host_scaling([make_run(1, 10.0, 10.0, 0.0, 1e9)], cores=2)


def test_one_rank_waiting_off_the_cpu_is_not_communication(make_run):
    model = truth(cores=2)
    runs = [measured(model, p, make_run) for p in (1, 2, 3)]
    runs[0].step_ms += 60.0  # another process took the core from the lone rank more than half the time
    fitted = fit_host_scaling(runs, cores=2)
    assert fitted.idle_ms == pytest.approx(60.0)
    parts = measured_parts(runs[0], fitted)
    assert parts.idle_ms == pytest.approx(60.0) and parts.comm_ms == 0.0
    assert bottleneck([parts], 2).startswith("bound by time off the CPU from 1 rank")


def with_input(run, wait_ms: float, cpu_ms: float):
    """`run` whose ranks also waited `wait_ms` per step in a DataLoader, `cpu_ms` of it decoding on their thread."""
    run.step_ms += wait_ms
    run.cpu_ms["cpu_main_ms"] += cpu_ms
    run.io = {"data_wait_ms": wait_ms, "data_cpu_ms": cpu_ms, "worker_cpu_ms": 0.0, "batches": 1}
    return run


def test_data_waiting_is_its_own_term_not_computation(make_run):
    model = truth(cores=2)
    runs = [with_input(measured(model, p, make_run), 60.0 + 10.0 * (p - 1), 55.0) for p in (1, 2, 3)]
    fitted = fit_host_scaling(runs, cores=2)
    assert fitted.input_ms == pytest.approx(60.0, rel=1e-3)
    assert fitted.input_ms_per_rank == pytest.approx(10.0, rel=1e-3)
    assert fitted.input_cpu_ms == pytest.approx(55.0) and fitted.a_ms == pytest.approx(5.0, rel=1e-3)
    one = fitted.predict(1)
    assert one.input_ms == pytest.approx(60.0, rel=1e-3) and one.compute_ms == pytest.approx(45.0, rel=1e-3)
    shared = fitted.predict(4)  # beyond the cores the decoding's CPU time shares them with the model's
    assert shared.input_ms == pytest.approx(55.0)
    assert shared.total_ms == pytest.approx(fitted.eta_bal * 4 * (shared.compute_ms + shared.comm_cpu_ms + 55.0) / 2)
    sentence = bottleneck([measured_parts(r, fitted) for r in runs], 2, "raise num_workers from 0, or pre-tokenise")
    assert sentence.startswith("input-bound from 1 rank: ranks wait 57% of the step for data: raise num_workers "
                               "from 0, or pre-tokenise")


def test_no_data_loader_leaves_the_model_as_it_was(make_run):
    model = truth(cores=2)
    plain = fit_host_scaling([measured(model, p, make_run) for p in (1, 2, 3)], cores=2)
    assert (plain.input_ms, plain.input_ms_per_rank, plain.input_cpu_ms) == (0.0, 0.0, 0.0)
    assert [plain.predict(p).input_ms for p in (1, 2, 4)] == [0.0, 0.0, 0.0]




def test_core_sharing_measured_beyond_the_cores_when_no_fitted_world_shared_them(make_run):
    model = truth(cores=2)
    two = [measured(model, p, make_run) for p in (1, 2)]
    fitted = fit_host_scaling(two, cores=2, sharing={3: 1.2, 5: 1.4})
    # the synthetic factor is what sharing the cores adds; eta_bal, what the real ranks lose to each other already
    e = fitted.eta_bal
    assert e > 1.03 and e == pytest.approx(model.eta_bal, rel=1e-6)
    assert [fitted.sharing_at(p) for p in (3, 4, 5, 8)] == pytest.approx([1.2 * e, 1.2 * e, 1.4 * e, 1.4 * e])
    assert fitted.predict(3).total_ms == pytest.approx(e * 1.2 * 3 * fitted.busy_ms(3) / 2)
    assert fitted.mu == 0.0 and fitted.shared_cpu == 1.0
    # nothing measured beyond the cores: an even spread's eta, the K-rank world's step over its CPU time
    alone = fit_host_scaling(two, cores=2)
    assert alone.sharing_at(3) == alone.eta_bal == pytest.approx(model.eta_bal, rel=1e-6)
    three = fit_host_scaling([*two, measured(model, 3, make_run)], cores=2, sharing={3: 1.2})
    assert three.sharing == {} and three.sharing_at(3) == pytest.approx(model.sharing_at(3), rel=1e-6)  # measured wins


def test_cpu_time_that_grows_when_every_core_is_busy_carries_beyond_the_cores(make_run):
    """A rank slower per step when the other cores are busy too (+25% here: shared caches, SMT siblings, a VM's
    host) is found from 1 and 2 ranks and carried to 3; ignoring it would predict 3 ranks about 17% low."""
    model = dataclasses.replace(truth(cores=2, strong=False), kappa=0.25)
    fitted = fit_host_scaling([measured(model, p, make_run) for p in (1, 2)], cores=2,
                              sharing={3: model.sharing_at(3) / model.eta_bal})
    assert fitted.kappa == pytest.approx(0.25, abs=0.01)
    assert fitted.predict(3).total_ms == pytest.approx(model.predict(3).total_ms, rel=0.02)
    assert fit_host_scaling([measured(truth(cores=2), p, make_run) for p in (1, 2, 3)], cores=2).kappa == 0.0


def test_an_uneven_spread_over_the_cores_costs_more_than_an_even_one():
    """3 ranks on 2 cores leave one core with two ranks and the other idle part of the step; 4 and 6 spread evenly
    and take eta_bal, the ratio of the K-rank world; 5 is less uneven than 3."""
    assert [imbalance(p, 2) for p in (1, 2, 4, 6)] == [0.0, 0.0, 0.0, 0.0]
    assert [imbalance(p, 2) for p in (3, 5)] == pytest.approx([1 / 3, 0.2])
    assert imbalance(10, 8) == pytest.approx(0.6) and imbalance(16, 8) == 0.0
    model = dataclasses.replace(truth(cores=2), eta_bal=1.1, mu=0.6)
    assert [model.sharing_at(p) for p in (4, 6, 8)] == pytest.approx([1.1, 1.1, 1.1])
    assert model.sharing_at(3) == pytest.approx(1.1 * 1.2) and model.sharing_at(5) == pytest.approx(1.1 * 1.12)
    assert model.predict(4).total_ms == pytest.approx(1.1 * 4 * model.busy_ms(4) / 2)


def test_the_step_beyond_the_cores_meets_the_step_within_them_at_k(make_run):
    """eta_bal is the K-rank world's step over the model's CPU time there: the formula beyond the cores, taken at
    K with an even spread, gives the K-rank step."""
    runs = [measured(truth(cores=2), p, make_run) for p in (1, 2, 3)]
    runs[1].step_ms *= 1.15  # ranks with a core each losing 15% more to each other
    fitted = fit_host_scaling(runs, cores=2)
    assert fitted.eta_bal * fitted.busy_ms(2) == pytest.approx(runs[1].step_ms, rel=1e-6)
    assert fitted.eta_bal * fitted.busy_ms(2) == pytest.approx(fitted.predict(2).total_ms, rel=1e-6)
    assert fitted.sharing_at(4) == pytest.approx(fitted.eta_bal)


def test_an_uneven_world_faster_than_an_even_spread_fits_mu_zero(make_run):
    runs = [measured(truth(cores=2, mu=0.0), p, make_run) for p in (1, 2, 3)]
    runs[2].step_ms *= 0.9  # 3 ranks below the K-rank world's ratio: nothing left of the imbalance
    fitted = fit_host_scaling(runs, cores=2)
    assert fitted.mu == 0.0 and fitted.sharing_at(3) == fitted.sharing_at(4) == pytest.approx(fitted.eta_bal)


def test_evenly_spread_oversubscribed_worlds_measure_eta_bal_and_leave_mu_zero(make_run):
    model = truth(cores=2, mu=0.6)
    runs = [measured(model, p, make_run) for p in (1, 2, 4)]
    runs[2].step_ms *= 1.1  # 4 ranks 10% above the K-rank world's ratio: eta_bal is the mean of both
    fitted = fit_host_scaling(runs, cores=2)
    assert fitted.mu == 0.0 and fitted.eta_bal == pytest.approx(model.eta_bal * 1.1 ** 0.5, rel=1e-6)


def test_cpu_time_sharing_a_core_is_measured_on_the_oversubscribed_worlds(make_run):
    """Ranks sharing a core spend more CPU per step than the model's terms give there (the oversubscribed world's
    measured CPU over the model's, relative to the same at K ranks): shared_cpu carries it beyond the cores, and
    eta keeps only the time beyond the CPU."""
    model = truth(cores=2, mu=0.0)
    runs = [measured(model, p, make_run) for p in (1, 2)]
    three = measured(model, 3, make_run)
    three.cpu_ms["cpu_main_ms"] *= 1.3  # the 3-rank world's ranks spent 30% more on their main thread ...
    three.step_ms *= (1 + 0.3 * model.predict(3).compute_ms / model.busy_ms(3))  # ... and the step grew with it
    fitted = fit_host_scaling([*runs, three], cores=2)
    assert fitted.shared_cpu > 1.05
    assert fitted.predict(3).total_ms == pytest.approx(three.step_ms, rel=1e-6)
    unshared = dataclasses.replace(fitted, shared_cpu=1.0)
    assert fitted.busy_ms(3) == pytest.approx(fitted.shared_cpu * unshared.busy_ms(3))
    assert fitted.busy_ms(2) == unshared.busy_ms(2)  # within the cores: the CPU terms as fitted
