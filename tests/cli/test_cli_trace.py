"""``spread run --trace DIR``: every rank traces a window of its fit's steps, the job ends with one
merged timeline; ``spread trace plot DIR`` draws it (issue 37 item 3)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from spread.cli.main import main

SPREAD = [sys.executable, "-m", "spread.cli.main"]

FIT = textwrap.dedent(
    """
    import torch, spread
    from torch import nn

    strategy = spread.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = (torch.randn(256, 16), torch.randint(0, 2, (256,)))
    spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy).fit(
        data, epochs=1, global_batch_size=32, verbose=0
    )
    """
)


@pytest.mark.processes
def test_spread_run_trace_merges_every_ranks_window_into_one_timeline(tmp_path):
    script, traces = tmp_path / "fit.py", tmp_path / "traces"
    script.write_text(FIT)
    done = subprocess.run(
        [*SPREAD, "run", "-n", "2", "--trace", str(traces), str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"spread run: one timeline of all ranks in {traces / 'timeline.json'}" in done.stdout
    events = json.loads((traces / "timeline.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert tracks == {"rank 0", "rank 1"}
    for rank in (0, 1):
        names = [e["name"] for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        assert names.count("spread.step") == 3  # steps 2-4 of 8
        assert "spread.gradient_exchange" in names and "spread.forward" in names
    plotted = subprocess.run(
        [*SPREAD, "trace", "plot", str(traces)], capture_output=True, text=True, timeout=120
    )
    assert plotted.returncode == 0, plotted.stderr
    assert (traces / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_spread_trace_names_a_directory_without_traces(tmp_path, capsys):
    assert main(["trace", "merge", str(tmp_path)]) == 1
    assert f"spread trace: error: no rank-<r>.json traces in {tmp_path}" in capsys.readouterr().err
