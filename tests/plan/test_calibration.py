"""Calibration profiles: file round trip, validation, the alpha-beta fit, and a real quick run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spread.plan.calibration import (
    CalibrationError,
    CalibrationProfile,
    calibrate,
    fit_link,
    load_profile,
    save_profile,
)
from spread.plan.cluster import ClusterModel
from spread.plan.costs import Link, allreduce_time, shard_collective_time


def _profile() -> CalibrationProfile:
    return CalibrationProfile(
        machine="test box",
        devices=4,
        memory_per_device=8 * 2**30,
        memory_bandwidth=1e10,
        matmul_flops=5e10,
        links={"native": Link(6e-4, 8e8), "shm": Link(2e-5, 8e9)},
        overlap=0.25,
        collective_in_step=1.8,
        sync_wait=0.004,
        busy_handoff=0.003,
        shard_unit_seconds=0.002,
        samples={"native": [[4096.0, 0.0012, 2.0]]},
    )


def test_round_trip(tmp_path):
    path = save_profile(_profile(), tmp_path / "sub" / "cal.json")
    assert load_profile(path) == _profile()
    assert not list(path.parent.glob(".*tmp*"))  # written atomically, nothing left over


def test_cluster_from_profile_uses_its_links_and_cores():
    cluster = ClusterModel.from_profile(_profile(), nodes=2, devices_per_node=4)
    assert cluster.intra["shm"] == Link(2e-5, 8e9)
    assert cluster.cores_per_node == 4 and cluster.overlap == 0.25 and cluster.collective_in_step == 1.8
    assert cluster.busy_handoff == 0.003 and cluster.sync_wait == 0.004
    assert cluster.shard_unit_seconds == 0.002
    assert cluster.link("native") == cluster.inter  # more than one node: the network


@pytest.mark.parametrize(
    "change, message",
    [
        ({"schema": 99}, "schema 99"),
        ({"devices": 0}, "'devices'"),
        ({"matmul_flops": "fast"}, "'matmul_flops'"),
        ({"overlap": 1.5}, "'overlap'"),
        ({"collective_in_step": 0.5}, "'collective_in_step'"),
        ({"collective_in_step": "x"}, "'collective_in_step'"),
        ({"busy_handoff": -0.001}, "'busy_handoff'"),
        ({"busy_handoff": 5}, "'busy_handoff'"),
        ({"sync_wait": -0.001}, "'sync_wait'"),
        ({"sync_wait": 2.0}, "'sync_wait'"),
        ({"sync_wait": True}, "'sync_wait'"),
        ({"shard_unit_seconds": -0.001}, "'shard_unit_seconds'"),
        ({"shard_unit_seconds": "slow"}, "'shard_unit_seconds'"),
        ({"links": {}}, "'links'"),
        ({"links": {"native": {"alpha": 1}}}, "link 'native'"),
    ],
)
def test_malformed_profiles_name_the_field(tmp_path, change, message):
    data = _profile().to_json() | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_a_profile_from_before_the_in_step_factor_loads_as_one(tmp_path):
    data = _profile().to_json()
    del data["collective_in_step"], data["busy_handoff"], data["sync_wait"], data["shard_unit_seconds"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_profile(tmp_path / "old.json")
    assert (old.collective_in_step, old.busy_handoff, old.sync_wait, old.shard_unit_seconds) == (
        1.0,
        0.0,
        0.0,
        0.0,
    )


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(CalibrationError, match="spread bench --calibrate"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_profile(tmp_path / "x.json")


@pytest.mark.parametrize("algorithm", ["native", "ring", "reduce_to_one", "shm"])
def test_fit_recovers_the_link_that_made_the_samples(algorithm):
    truth = Link(alpha=3e-4, beta=7e8)
    samples = [
        (s, allreduce_time(algorithm, s, n, truth), n) for s in (4e3, 6.4e4, 1e6, 1.6e7) for n in (2, 4)
    ]
    fitted = fit_link(algorithm, samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-6)


def test_the_shard_link_is_fitted_with_reduce_scatter_terms():
    """ShardedStrategy's collectives: n - 1 messages of 1/n of the buffer (not an all-reduce's 2x)."""
    truth = Link(alpha=2e-4, beta=1e9)
    samples = [(s, shard_collective_time(s, n, truth), n) for s in (4e3, 1e6, 1.6e7) for n in (2, 4)]
    fitted = fit_link("shard", samples)
    assert (fitted.alpha, fitted.beta) == (pytest.approx(truth.alpha), pytest.approx(truth.beta))


def test_fit_needs_two_samples():
    with pytest.raises(CalibrationError, match="at least two"):
        fit_link("ring", [(1e6, 0.01, 2)])


@pytest.mark.processes
def test_quick_calibration_measures_every_algorithm(tmp_path):
    profile = calibrate(tmp_path / "cal.json", quick=True)
    assert {"native", "ring", "shm", "reduce_to_one", "hierarchical", "memory", "ps", "shard"} <= set(
        profile.links
    )
    # one sample per size; the shard link two (a reduce-scatter and an all-gather)
    assert {len(samples) for name, samples in profile.samples.items() if name != "shard"} == {3}
    assert len(profile.samples["shard"]) == 6
    assert profile.matmul_flops > 0 and 0.0 <= profile.overlap <= 1.0
    assert 0.0 < profile.busy_handoff < 1.0  # busy children forked beside the ranks, then reaped
    assert 0.0 <= profile.sync_wait < 1.0
    assert 0.0 < profile.shard_unit_seconds < 1.0  # a ShardedStrategy unit's cycle costs something
    assert load_profile(tmp_path / "cal.json") == profile


@pytest.mark.processes
def test_calibration_in_rounds_fits_every_rounds_samples(tmp_path):
    profile = calibrate(tmp_path / "cal.json", quick=True, rounds=2)
    assert {len(samples) for name, samples in profile.samples.items() if name != "shard"} == {6}
    assert profile.collective_in_step >= 1.0 and 0.0 < profile.busy_handoff < 1.0
    with pytest.raises(ValueError, match="rounds"):
        calibrate(tmp_path / "bad.json", quick=True, rounds=0)


def test_a_gpu_machine_with_fewer_gpus_than_link_processes_is_refused_before_starting_them(
    tmp_path, monkeypatch
):
    from spread.plan import measure

    monkeypatch.setattr(measure.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        measure.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(measure, "launch", lambda config: pytest.fail("no job may start"))
    with pytest.raises(CalibrationError, match=r"2 processes, one per GPU .* this machine has 1"):
        calibrate(tmp_path / "cal.json", quick=True)
    assert not (tmp_path / "cal.json").exists()
