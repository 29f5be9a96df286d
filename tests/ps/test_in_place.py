"""A lost parameter server restored in place while the training task waits (spread.ps.in_place), with
real servers in this process: one stopped, a replacement started at its address. Sync mode replays the
steps since the backup and ends with the uninterrupted weights; async mode applies the step in flight
once and loses that server's updates since the backup (as documented). The launcher's side (a server
SIGKILLed under spread run --recover): tests/ps/test_in_place_launch.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.checkpoint import CheckpointManager
from spread.errors import ParameterServerError, SpreadError
from spread.ps.in_place import ReplayLog
from spread.ps.server import ParameterServer, state_digest
from spread.testing import chief_of

TOKEN = "in-place-test-token"
STEPS = 7
BACKUP_AT = 3
LOSE_AT = 5  # server 1 is lost after steps 3 and 4 reached it (after the backup)


def _train(
    tmp_path: Path,
    monkeypatch,
    mode: str,
    *,
    lose: bool,
    replacement: bool = True,
    backup: bool = True,
    transport: str = "zmq",
) -> dict:
    monkeypatch.setenv("SPREAD_JOB_TOKEN", TOKEN)
    servers = [ParameterServer(i, token=TOKEN, transport=transport).start() for i in range(2)]
    spec = chief_of([s.address for s in servers])
    strategy = spread.ParameterServerStrategy(
        mode,
        cluster=spec,
        timeout=10,
        restore_in_place=True,
        restore_timeout=1.5 if not replacement else 30,
        transport=transport,
    )
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))  # 4 tensors over 2 servers
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(1)
        batches = [torch.randn(16, 4, generator=data) for _ in range(STEPS)]
        for step, x in enumerate(batches):
            if step == BACKUP_AT and backup:
                strategy.save_servers(tmp_path / "backup")
            if step == LOSE_AT and lose:
                servers[1].stop()
                if replacement:
                    address = servers[1].address
                    servers[1] = ParameterServer(
                        1, token=TOKEN, address=address, replacement=1, transport=transport
                    )
                    servers[1].start()
            optimizer.zero_grad()
            strategy.run(lambda x=x: model(x).pow(2).mean().backward())
            optimizer.step()
        strategy.refresh_weights()
        return {
            "weights": [p.detach().clone() for p in model.parameters()],
            "stats": strategy.server_stats(ids=True),
            "restores": list(strategy._in_place.restores),
            "session": strategy._session,
        }
    finally:
        strategy.leave_worker_shutdown_to_coordinator()
        strategy.close()
        for s in servers:
            s.stop()


def _backup_digest(directory: Path, server: int) -> str:
    step, payload = CheckpointManager(directory).load_latest()
    assert step == BACKUP_AT
    return state_digest(payload["servers"][str(server)])


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_sync_mode_replays_the_steps_since_the_backup_and_ends_with_the_uninterrupted_weights(
    tmp_path, monkeypatch, transport
):
    reference = _train(tmp_path / "ref", monkeypatch, "sync", lose=False, transport=transport)
    run = _train(tmp_path / "run", monkeypatch, "sync", lose=True, transport=transport)
    (restore,) = run["restores"]
    assert restore["server"] == 1 and restore["backup"] == f"{BACKUP_AT}-servers"
    assert restore["replayed"] == [3, 4]  # the steps after the backup, before the one in flight
    assert restore["digest"] == _backup_digest(tmp_path / "run" / "backup", 1)  # restored = the backup
    for got, want in zip(run["weights"], reference["weights"], strict=True):
        assert torch.equal(got, want)  # the same sums in the same order: bit for bit
    assert [s["version"] for s in run["stats"]] == [STEPS, STEPS]
    assert run["stats"][1]["replacement"] == 1 and run["stats"][0]["replacement"] == 0


def test_without_the_replay_the_restored_server_would_miss_the_steps_since_the_backup():
    """The replay is what makes the sync run exact: the restored server starts at the backup."""
    log = ReplayLog()
    log.record(0, {0: ({"step": 0, "pull": ["a"]}, {"g": torch.ones(2)})})  # before any backup: not kept
    log.backed_up(1)
    log.record(1, {0: ({"step": 1, "pull": ["a"]}, {"g": torch.ones(2)})})
    log.record(2, {0: ({"step": 2, "pull": ["a"]}, {"g": torch.ones(2)})})
    assert [s for s, _ in log.parts(0, 1, 3)] == [1, 2]
    assert log.parts(0, 1, 3)[0][1][0]["pull"] == []  # a replay asks for nothing back
    with pytest.raises(ValueError, match=r"needs steps 0-2 again and this task holds steps 1-2"):
        log.parts(0, 0, 3)
    log.backed_up(2)
    log.backed_up(3)  # the steps before the second-to-last backup (2) are dropped
    with pytest.raises(ValueError, match=r"missing: \[1\]"):
        log.parts(0, 1, 3)


def test_async_mode_applies_the_step_in_flight_once_and_loses_the_servers_updates_since_the_backup(
    tmp_path, monkeypatch
):
    run = _train(tmp_path, monkeypatch, "async", lose=True)
    (restore,) = run["restores"]
    assert restore["replayed"] == [] and restore["digest"] == _backup_digest(tmp_path / "backup", 1)
    ids = [{int(i.rsplit(".", 1)[1]) for i in s["applied_ids"]} for s in run["stats"]]
    assert ids[0] == set(range(STEPS))
    assert ids[1] == set(range(STEPS)) - {3, 4}  # lost with the server: after the backup, before the loss
    for s in run["stats"]:
        assert s["applied"] == len(s["applied_ids"])  # nothing applied twice


def test_a_server_not_back_within_the_timeout_is_named_with_the_operation(tmp_path, monkeypatch):
    with pytest.raises(ParameterServerError) as caught:
        _train(tmp_path, monkeypatch, "async", lose=True, replacement=False)
    message = str(caught.value)
    assert message.startswith("parameter server 1 (127.0.0.1:"), message
    assert f"push (step {LOSE_AT}) failed: lost (" in message
    assert "not back and restored from its backup within 1.5s" in message
    assert caught.value.server == 1


def test_a_replacement_with_no_backup_to_restore_from_fails_naming_why(tmp_path, monkeypatch):
    with pytest.raises(SpreadError, match="the chief has written no backup to restore it from"):
        _train(tmp_path, monkeypatch, "sync", lose=True, backup=False)


def test_a_refusal_from_a_server_that_was_never_lost_is_raised_at_once(monkeypatch):
    """Only a replacement is waited for: any other ParameterServerError is the caller's."""
    monkeypatch.setenv("SPREAD_JOB_TOKEN", TOKEN)
    servers = [ParameterServer(i, token=TOKEN).start() for i in range(2)]
    strategy = spread.ParameterServerStrategy(
        cluster=chief_of([s.address for s in servers]), timeout=10, restore_in_place=True
    )
    try:
        refused = ParameterServerError("parameter server 0 (x)", "push", "refused for a reason of its own")
        refused.server = 0
        calls = []

        def fails() -> None:
            calls.append(1)
            raise refused

        with pytest.raises(ParameterServerError, match="refused for a reason of its own"):
            strategy._calling("push", fails)
        assert calls == [1]
    finally:
        strategy.leave_worker_shutdown_to_coordinator()
        strategy.close()
        for s in servers:
            s.stop()


def test_restore_settings_are_checked(monkeypatch):
    monkeypatch.setenv("SPREAD_JOB_TOKEN", TOKEN)
    spec = chief_of(["127.0.0.1:1"])
    with pytest.raises(ValueError, match="restore_timeout must be a finite number of seconds > 0"):
        spread.ParameterServerStrategy(cluster=spec, restore_timeout=0)
    with pytest.raises(ValueError, match="restore_in_place must be None, True or False"):
        spread.ParameterServerStrategy(cluster=spec, restore_in_place="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("SPREAD_PS_RESTORE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SPREAD_PS_RESTORE_TIMEOUT must be a number of seconds"):
        spread.ParameterServerStrategy(cluster=spec)
