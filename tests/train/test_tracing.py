"""One timeline of all ranks (issue 37 item 3): a traced window of steps per rank, merged on one clock
with a track per rank, and a picture of it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import spread
from spread.train.timeline import merge_traces, plot_timeline, spans
from spread.train.tracing import TRACE_DIR_ENV, TraceWindow


def _rank_trace(path, base_ns: int, events: list[tuple[str, float, float]]) -> None:
    spans_ = [{"ph": "X", "name": n, "ts": ts, "dur": dur, "pid": 77, "tid": 1} for n, ts, dur in events]
    meta = [{"ph": "M", "name": "process_name", "pid": 77, "args": {"name": "python"}}]
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": spans_ + meta}))


def test_ranks_are_put_on_one_clock_each_on_its_own_track(tmp_path):
    # rank 1's profiler started 2 ms after rank 0's: its ts 1000 us is rank 0's 3000 us
    rank_0 = [("spread.step", 1000.0, 500.0), ("aten::mm", 1100, 10)]
    _rank_trace(tmp_path / "rank-0.json", 5_000_000_000, rank_0)
    _rank_trace(tmp_path / "rank-1.json", 5_002_000_000, [("spread.step", 1000.0, 700.0)])
    merged = json.loads(merge_traces(tmp_path).read_text())["traceEvents"]
    steps = {e["pid"]: e["ts"] for e in merged if e.get("name") == "spread.step"}
    assert steps == {0: 0.0, 1: 2000.0}
    names = {e["pid"]: e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert spans(tmp_path / "timeline.json") == {0: [("step", 0.0, 0.5)], 1: [("step", 2.0, 0.7)]}


def test_no_traces_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no rank-<r>.json traces in"):
        merge_traces(tmp_path)


def test_the_window_comes_from_profile_or_from_spread_run(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    assert TraceWindow.of(None) is None
    assert TraceWindow.of(tmp_path) == TraceWindow(tmp_path, 2, 3)
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "from-run"))
    assert TraceWindow.of(None) == TraceWindow(tmp_path / "from-run")
    with pytest.raises(ValueError, match=r"first_step >= 0 and steps >= 1"):
        TraceWindow(tmp_path, steps=0)


def test_a_traced_fit_writes_its_ranks_trace_and_the_timeline(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trainer = spread.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        profile=TraceWindow(tmp_path, first_step=1, steps=2),
    )
    trainer.fit((torch.randn(64, 8), torch.randint(0, 2, (64,))), epochs=1, global_batch_size=8, verbose=0)
    assert (tmp_path / "rank-0.json").exists() and (tmp_path / "timeline.json").exists()
    lanes = spans(tmp_path / "timeline.json")
    kinds = [kind for kind, _, _ in lanes[0]]
    assert kinds.count("step") == 2  # the window: steps 1 and 2 of 8
    assert {"forward", "backward", "data wait"} <= set(kinds)
    picture = plot_timeline(tmp_path / "timeline.json", tmp_path / "timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_fit_shorter_than_the_window_writes_what_it_has(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    window = TraceWindow(tmp_path, 0, 10)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), profile=window)
    trainer.fit((torch.randn(16, 4), torch.randint(0, 2, (16,))), epochs=1, global_batch_size=8, verbose=0)
    assert [k for k, _, _ in spans(tmp_path / "timeline.json")[0]].count("step") == 2
