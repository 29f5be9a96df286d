"""Run every example, and the scripts of issue 16, many times in a row under ``spread run``; count the
runs that did not end with the exit code they should have.

Why: an abort at exit (``terminate called without an active exception``, SIGABRT, exit code 134
after training had finished) is a race that shows in a few runs out of dozens, and under
``--max-restarts`` it would restart a finished job. One run proves nothing; fifty in a row with zero
unexpected exits is the check. Cases run round-robin (one run of each case per round) so that a
change in the machine's load hits every case alike.

Cases: each example in ``examples/`` with the arguments ``tests/`` runs it with (fewer epochs: the
exit path does not depend on them), the two scripts the issue reported (a 2-stage GPipe
``Trainer.fit`` of a 7-layer MLP and the README's MultiWorkerMirrored example, neither calling
``strategy.close()``), two failure endings whose exit code must be the script's: ``sys.exit(3)``
mid-fit on every rank, and an exception on rank 1 (exit code 1), and a plain torch.distributed
script in nanoGPT's style, under ``spread run`` and, as the reference, under torchrun.

    python benchmarks/exit_stress.py                        # 50 runs of every case
    python benchmarks/exit_stress.py --runs 5 --cases custom_loop,issue16_pipeline_noclose
    python benchmarks/exit_stress.py --list

Heavy: run it under ``flock /tmp/spread-bench.lock`` on a shared machine. ``PYTHONPATH`` is passed on
to ``spread run``, so ``PYTHONPATH=<a checkout>/src`` measures that checkout.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPREAD = Path(sys.executable).parent / "spread"
TORCHRUN = Path(sys.executable).parent / "torchrun"
ABORT_MARKERS = (
    "terminate called",
    "Fatal Python error",
    "core dumped",
    "Aborted",
    "SIGABRT",
    "SIGSEGV",
    "Segmentation fault",
)

_TRAIN_HEAD = """
import os, sys, torch, spread
from torch import nn
from spread.train.callbacks import Callback

torch.manual_seed(0)
rank = int(os.environ["RANK"])
"""

SCRIPTS = {
    # Issue 16: a 2-stage GPipe Trainer.fit of a 7-layer MLP, 4 micro-batches, no close().
    "issue16_pipeline": _TRAIN_HEAD
    + """
strategy = spread.PipelineStrategy(stages=2, microbatches=4, schedule="gpipe")
x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
with strategy.scope():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((x, y), epochs=3, global_batch_size=64, verbose=0)
""",
    # The README's MultiWorkerMirrored example as it stands: no close().
    "readme_mwms": _TRAIN_HEAD
    + """
strategy = spread.MultiWorkerMirroredStrategy()
x_train, y_train = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
x_val, y_val = torch.randn(256, 64), torch.randint(0, 10, (256,))
with strategy.scope():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
trainer.fit((x_train, y_train), epochs=3, global_batch_size=256, validation_data=(x_val, y_val), verbose=0)
trainer.evaluate((x_val, y_val))
""",
    # Ending early: sys.exit(3) on every rank, or an exception on rank 1, in the middle of fit.
    "fault": _TRAIN_HEAD
    + """
kind, fault = sys.argv[1], sys.argv[2]
if kind == "pipeline":
    strategy = spread.PipelineStrategy(stages=2, microbatches=4, schedule="gpipe")
else:
    strategy = spread.MultiWorkerMirroredStrategy()
x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
with strategy.scope():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


class Fault(Callback):
    def on_train_batch_end(self, step, logs=None):
        if step == 5 and fault == "exit":
            sys.exit(3)
        if step == 5 and fault == "raise" and rank == 1:
            raise ValueError("injected on rank 1")


trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((x, y), epochs=2, global_batch_size=64, verbose=0, callbacks=[Fault()])
""",
}


_TORCHRUN_FLAGS = ("--standalone", "--nproc_per_node=2")
_NANOGPT = "tests/cluster/scripts/nanogpt_style.py"


@dataclass(frozen=True)
class Case:
    name: str
    launch: tuple[str, ...]  # the launcher's options
    script: str  # a path in the repository, or a key of SCRIPTS
    args: tuple[str, ...] = ()
    expected: int = 0  # the exit code the run must end with
    launcher: str = "spread run"  # or "torchrun": the reference, not counted in the exit status


CASES = [
    Case("digits", ("-n", "2"), "examples/digits.py", ("--epochs", "5", "--verbose", "0")),
    Case("custom_loop", ("-n", "2"), "examples/custom_loop.py", ("--steps", "20")),
    Case("pipeline", ("-n", "2"), "examples/pipeline.py", ("--epochs", "3")),
    Case("hf_gpt2", ("-n", "2"), "examples/hf_gpt2.py"),
    Case("tensor_parallel", ("-n", "2"), "examples/tensor_parallel.py", ("--epochs", "1")),
    Case(
        "parameter_server",
        ("--workers", "2", "--ps", "2"),
        "examples/parameter_server.py",
        ("--coordinator", "--epochs", "2"),
    ),
    Case("issue16_pipeline_noclose", ("-n", "2"), "issue16_pipeline"),
    Case("readme_mwms_noclose", ("-n", "2"), "readme_mwms"),
    Case("pipeline_sys_exit", ("-n", "2"), "fault", ("pipeline", "exit"), expected=3),
    Case("mwms_raise_on_rank1", ("-n", "2"), "fault", ("mwms", "raise"), expected=1),
    # A plain torch.distributed script (no spread inside) that ends right after its last collective.
    Case("nanogpt_style", _TORCHRUN_FLAGS, _NANOGPT, ("--max_iters=4",)),
    Case("nanogpt_style_torchrun", _TORCHRUN_FLAGS, _NANOGPT, ("--max_iters=4",), launcher="torchrun"),
]


@dataclass
class Tally:
    case: Case
    codes: collections.Counter = field(default_factory=collections.Counter)
    unexpected: int = 0
    first_abort: str = ""
    seconds: list[float] = field(default_factory=list)

    @property
    def runs(self) -> int:
        return sum(self.codes.values())


def abort_line(output: str) -> str:
    """The first line of ``output`` that reports an abort or a crash ("" when none does)."""
    for line in output.splitlines():
        if any(marker in line for marker in ABORT_MARKERS):
            return line.strip()
    return ""


def _command(case: Case, scripts: Path) -> list[str]:
    path = scripts / f"{case.script}.py" if case.script in SCRIPTS else ROOT / case.script
    launcher = [str(TORCHRUN)] if case.launcher == "torchrun" else [str(SPREAD), "run"]
    return [*launcher, *case.launch, str(path), *case.args]


def run_once(case: Case, scripts: Path, timeout: float) -> tuple[int, str, float, str]:
    """One run: (exit code, first abort line, seconds, output); a run past ``timeout`` counts as -9."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    started = time.perf_counter()
    try:
        done = subprocess.run(
            _command(case, scripts),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = "".join(
            part.decode(errors="replace") if isinstance(part, bytes) else part or ""
            for part in (exc.stdout, exc.stderr)
        )
        seconds = time.perf_counter() - started
        return -9, abort_line(out) or f"still running after {timeout:g}s", seconds, out
    output = done.stdout + done.stderr
    return done.returncode, abort_line(output), time.perf_counter() - started, output


def stress(
    cases: list[Case],
    runs: int,
    timeout: float = 300.0,
    progress: bool = False,
    keep_output: Path | None = None,
) -> list[Tally]:
    """``runs`` rounds of one run per case; every case's exit codes, unexpected exits, first abort.
    With ``keep_output``, the output of every unexpected run is written there."""
    tallies = [Tally(case) for case in cases]
    with tempfile.TemporaryDirectory(prefix="spread-exit-stress-") as tmp:
        scripts = Path(tmp)
        for name, body in SCRIPTS.items():
            (scripts / f"{name}.py").write_text(textwrap.dedent(body))
        for round_ in range(runs):
            for tally in tallies:
                code, abort, seconds, output = run_once(tally.case, scripts, timeout)
                tally.codes[code] += 1
                tally.seconds.append(seconds)
                if code != tally.case.expected or abort:
                    tally.unexpected += 1
                    tally.first_abort = tally.first_abort or abort or f"exit code {code}"
                    if keep_output is not None:
                        keep_output.mkdir(parents=True, exist_ok=True)
                        (keep_output / f"{tally.case.name}-run{round_ + 1}.txt").write_text(output)
                if progress:
                    mark = "ok" if code == tally.case.expected and not abort else f"UNEXPECTED {code}"
                    print(f"round {round_ + 1}/{runs} {tally.case.name}: {mark} ({seconds:.1f}s)", flush=True)
    return tallies


def report(tallies: list[Tally]) -> str:
    header = ["case", "expected exit", "runs", "unexpected exits", "exit codes (count)", "first abort line"]
    lines = ["| " + " | ".join([*header, "median s"]) + " |", "|" + " --- |" * (len(header) + 1)]
    for t in tallies:
        codes = ", ".join(f"{code}: {n}" for code, n in sorted(t.codes.items()))
        median = statistics.median(t.seconds) if t.seconds else float("nan")
        abort = t.first_abort.replace("|", "\\|") or "-"
        cells = [t.case.name, t.case.expected, t.runs, t.unexpected, codes, abort, f"{median:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _select(names: str | None) -> list[Case]:
    if not names:
        return list(CASES)
    by_name = {c.name: c for c in CASES}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {sorted(by_name)}")
    return [by_name[n] for n in names.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=50, help="consecutive runs of each case (default 50)")
    parser.add_argument("--cases", help="comma-separated case names (default: all; see --list)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take (default 300)")
    parser.add_argument("--json", type=Path, help="also write the tallies to this file")
    parser.add_argument("--keep-output", type=Path, help="write each unexpected run's output to this folder")
    parser.add_argument("--list", action="store_true", help="print the cases and their commands, then exit")
    parser.add_argument("--quiet", action="store_true", help="no line per run")
    args = parser.parse_args(argv)
    cases = _select(args.cases)
    if args.list:
        for case in cases:
            script = f"{case.script}.py (written by this file)" if case.script in SCRIPTS else case.script
            command = " ".join([case.launcher, *case.launch, script, *case.args])
            print(f"{case.name}: {command}")
        return 0
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    started = time.perf_counter()
    tallies = stress(cases, args.runs, args.timeout, progress=not args.quiet, keep_output=args.keep_output)
    print(
        f"\n{args.runs} run(s) per case in {time.perf_counter() - started:.0f}s, spread from "
        f"{os.environ.get('PYTHONPATH') or 'the installed package'}:\n"
    )
    print(report(tallies))
    if args.json is not None:
        rows = [
            {
                "case": t.case.name,
                "expected": t.case.expected,
                "runs": t.runs,
                "unexpected": t.unexpected,
                "codes": {str(k): v for k, v in t.codes.items()},
                "first_abort": t.first_abort,
                "median_seconds": statistics.median(t.seconds),
            }
            for t in tallies
        ]
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if any(t.unexpected for t in tallies if t.case.launcher == "spread run") else 0


if __name__ == "__main__":
    sys.exit(main())
