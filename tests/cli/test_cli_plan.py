"""``spread plan`` from the command line: an end-to-end run on the digits example, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")
SPREAD = [sys.executable, "-m", "spread.cli.main", "plan"]


def _plan(
    *args: str, cwd: Path | None = None, env: dict | None = None, profile_seconds: str | None = "0"
) -> subprocess.CompletedProcess[str]:
    """``spread plan ARGS``; ``profile_seconds`` None: the default's half minute of timing rounds."""
    timing = [] if profile_seconds is None else ["--profile-seconds", profile_seconds]
    return subprocess.run(
        [*SPREAD, *args, *timing],
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
    )


def _env_with_path(directory: Path) -> dict[str, str]:
    """This environment with ``directory`` first on PYTHONPATH; the rest is kept, made absolute (the
    command runs elsewhere), since it may name the spread under test."""
    kept = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), *kept])}


def test_digits_end_to_end_json(tmp_path):
    result = _plan(DIGITS, "--devices", "2", "--json", cwd=tmp_path, profile_seconds=None)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    labels = {p["label"] for p in plan["predictions"]}
    assert {"one_device", "mirrored", "multi_worker_mirrored[shm]", "multi_worker_mirrored[native]"} <= labels
    assert plan["recommended"] in labels
    assert all(p["samples_per_second"] > 0 and p["fits"] for p in plan["predictions"])
    assert not list(tmp_path.iterdir())  # the script was stopped at fit: no training, no files


def test_digits_table_on_two_nodes_with_a_slow_network(tmp_path):
    result = _plan(
        DIGITS, "--devices", "8", "--nodes", "2", "--link-gbps", "1", "--memory-gb", "1", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "multi_worker_mirrored[hierarchical]" in result.stdout
    assert "recommended:" in result.stdout and "2 node(s) x 4 device(s)" in result.stdout


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    result = _plan(DIGITS, "--devices", "2", "--plot", str(png), "--plot-max-devices", "64", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--devices", "3", "--nodes", "2"],
            "impossible cluster: 3 devices cannot be spread evenly over 2 nodes",
        ),
        (["--strategies", "horovod"], "unknown strategy 'horovod'"),
        (["--devices", "2", "--memory-gb", "0.0001"], "fits on no strategy"),
        (["--devices", "128"], "cannot be split over 128 devices"),
        (["--profile", "missing.json"], "spread bench --calibrate"),
        (["--profile-seconds", "-1"], "must be a finite number >= 0, got -1"),
        (["--profile-seconds", "soon"], "expected a number of seconds, got 'soon'"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, args, message):
    result = _plan(DIGITS, *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_script_without_fit_and_factory(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("print('custom loop, no Trainer')\n")
    result = _plan(str(script), cwd=tmp_path)
    assert result.returncode == 2 and "--model module:function" in result.stderr
    (tmp_path / "factory.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def make():
                model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
                return model, nn.CrossEntropyLoss(), torch.randn(64, 16), torch.randint(0, 4, (64,))
            """
        )
    )
    env = _env_with_path(tmp_path)
    result = _plan("--model", "factory:make", "--devices", "2", "--json", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["predictions"]
    both = _plan(str(script), "--model", "factory:make", cwd=tmp_path, env=env)
    assert both.returncode == 2 and "one of them" in both.stderr


def test_factory_name_is_printed_as_written(tmp_path):
    # rich would print "plan_cnn:factory" as "plan_cnn🏭" (":factory:" is an emoji code) if it parsed it.
    (tmp_path / "plan_cnn.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def factory():
                model = nn.Sequential(nn.Linear(8, 4))
                return model, nn.CrossEntropyLoss(), torch.randn(16, 8), torch.randint(0, 4, (16,))
            """
        )
    )
    env = _env_with_path(tmp_path)
    result = _plan("--model", "plan_cnn:factory", "--devices", "2", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "model plan_cnn:factory: " in result.stdout
    assert "🏭" not in result.stdout


def test_without_a_profile_a_machine_with_gpus_plans_its_gpus(monkeypatch):
    """On CUDA the script's default strategy trains on the GPUs: the default cluster is those GPUs
    (their number and memory), not the machine's cores."""
    import argparse
    from types import SimpleNamespace

    import torch

    from spread.cli import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30)
    )
    monkeypatch.setattr(plan, "DEFAULT_PROFILE", "no-such-profile.json")
    args = argparse.Namespace(
        profile=None,
        devices=None,
        nodes=1,
        memory_gb=None,
        link_gbps=None,
        link_latency_us=None,
        compute_scale=1.0,
    )
    cluster, cores = plan._cluster(args)
    assert (cluster.devices_per_node, cluster.cores_per_node, cores) == (4, None, None)
    assert cluster.memory_per_device == 80 * 2**30
    args.devices, args.memory_gb = 8, 16.0  # what the command line says wins
    cluster, _ = plan._cluster(args)
    assert (cluster.devices_per_node, cluster.memory_per_device) == (8, 16 * 2**30)


_HF_FACTORY = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64


def on_logits(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, VOCAB, (16, 16))
    return model, {loss_fn}, {{"input_ids": ids, "labels": ids}}, ids
"""


@pytest.mark.parametrize("loss_fn", ["None", "on_logits"])
def test_a_hugging_face_factory_is_planned(tmp_path, loss_fn):
    """A factory returning a GPT-2 with its keyword inputs: the model's own loss (``loss_fn=None``) or
    a loss on the logits (it got the whole ModelOutput: "object has no attribute 'reshape'")."""
    pytest.importorskip("transformers")
    (tmp_path / "hf_factory.py").write_text(_HF_FACTORY.format(loss_fn=loss_fn))
    result = _plan(
        "--model", "hf_factory:make", "--devices", "2", "--json", cwd=tmp_path, env=_env_with_path(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert all(p["samples_per_second"] > 0 for p in json.loads(result.stdout)["predictions"])


def _readme_hugging_face_example() -> str:
    """The Python block of the README's "Hugging Face models" section."""
    section = (ROOT / "README.md").read_text().split("### Hugging Face models", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("script", ["examples/hf_gpt2.py", "README.md"])
def test_the_documented_hugging_face_scripts_are_planned(tmp_path, script):
    """``examples/hf_gpt2.py`` and the README's BERT fine-tuning train with ``loss_fn=None``, which
    ``spread plan`` refused."""
    pytest.importorskip("transformers")
    path = ROOT / script
    if script == "README.md":
        path = tmp_path / "finetune.py"
        path.write_text(_readme_hugging_face_example())
    result = _plan(str(path), "--devices", "2", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(p["samples_per_second"] > 0 for p in json.loads(result.stdout)["predictions"])
