"""Validate ``spread plan`` on this machine: predicted vs measured step time, and the recommendation.

For each workload (W1, W2, W3 of benchmarks/block_workloads.py, or the seven families of
benchmarks/model_families.py: mlp, cnn, resnet, transformer, gpt2, recommender, lstm) and process
count N, every configuration that runs on one machine is predicted (from the calibration profile and
a profile of the model taken here) and then measured for real (benchmarks/_validation_worker.py
under ``spread run``). Reports the error of each prediction, the median absolute error, and whether
the recommended configuration was the measured best in each (workload, N) cell.

    python benchmarks/plan_validation.py [--workloads W1,W2,W3] [--procs 2,3,4] [--profile PATH]
        [--steps 5] [--passes 1] [--json results.json]
    python benchmarks/plan_validation.py --replay results.json [results2.json ...] [--reprofile]
    python benchmarks/plan_validation.py --confirm results.json [--rounds 2] [--steps 5]

``--json`` keeps the model profiles and the calibration with the measured rows, so ``--replay`` can
predict the same configurations again with the current cost model, without measuring anything (to
see what a change to the model does to the error and the recommendations). Several files are merged.
``--reprofile`` profiles the models again first (to try a change to what the profile measures; the
machine should be the one, and as quiet as the one, that measured the rows).
``--passes K`` profiles each family and measures every configuration K times, in passes with the
families in rotated order; a row reports the median of its passes' predictions and measurements (each
pass predicts from a profile taken minutes before its measurements), and each pass's own error is
printed beside it.
``--confirm results.json [--rounds 2]`` measures every configuration within 15% of its cell's best (and
the recommended one) again in interleaved rounds, and ranks by those rounds alone (a fairer ranking on
a machine whose speed drifts between configurations measured minutes apart).

Every process runs with the allocator settings spread gives the processes it starts
(spread/cluster/allocator.py): the multi-process rows get them from ``spread run``, the profiles from
``tune_this_process`` as in ``spread plan``, and the one-process rows (plain ``python``) through
their environment, as ``spread run -n 1`` would give them.

Timing runs one at a time; nothing else should load the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model_families as workloads  # noqa: E402

from spread.cli.plan import PROFILE_SECONDS  # noqa: E402
from spread.cluster.allocator import tune_child_environment, tune_this_process  # noqa: E402
from spread.plan.advisor import make_plan  # noqa: E402
from spread.plan.calibration import CalibrationProfile, calibrate, load_profile  # noqa: E402
from spread.plan.cluster import ClusterModel  # noqa: E402
from spread.plan.predict import Candidate, Options, predict  # noqa: E402
from spread.plan.workload import LayerProfile, ModelProfile, measure_model  # noqa: E402

MEASURABLE = {
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker_mirrored",
    "parameter_server",
    "pipeline",
    "sharded",
}


def _measure(workload: str, candidate, steps: int, timeout: float) -> float | None:
    """Median step seconds of ``candidate`` measured for real, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="spread-validate-") as folder:
        out = os.path.join(folder, "result.json")
        worker = [
            str(HERE / "_validation_worker.py"),
            "--workload",
            workload,
            "--output",
            out,
            "--steps",
            str(steps),
            "--strategy",
            candidate.strategy,
        ]
        n = candidate.devices
        run = [sys.executable, "-m", "spread.cli.main", "run"]
        if candidate.strategy == "multi_worker_mirrored":
            cmd = [*run, "-n", str(n), *worker, "--communication", candidate.get("communication")]
        elif candidate.strategy == "parameter_server":
            servers = candidate.get("servers")
            sync = ["--sync-dir", folder]  # the training tasks start timing together
            cmd = [*run, "--workers", str(n - servers - 1), "--ps", str(servers), *worker, *sync]
        elif candidate.strategy == "pipeline":
            stages, micro = str(candidate.get("stages")), str(candidate.get("microbatches"))
            schedule = candidate.get("schedule")
            cmd = [
                *run,
                "-n",
                str(n),
                *worker,
                "--stages",
                stages,
                "--microbatches",
                micro,
                "--schedule",
                schedule,
            ]
        elif candidate.strategy == "sharded":
            cmd = [*run, "-n", str(n), *worker, "--shard", candidate.get("shard")]
        elif candidate.strategy == "one_device":
            cmd = [sys.executable, *worker, "--threads", str(os.cpu_count() or 1)]
        else:
            cmd = [sys.executable, *worker, "--replicas", str(n)]
        environ = dict(os.environ)
        tune_child_environment(environ)  # `spread run` sets it for its ranks; the one-process rows here
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=environ
            )
        except subprocess.TimeoutExpired:
            print(f"  timed out: {candidate.label}", file=sys.stderr)
            return None
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"  failed: {candidate.label}: {proc.stderr[-500:]}", file=sys.stderr)
            return None
        if candidate.strategy == "parameter_server":
            return _job_step_seconds(folder, candidate.devices - candidate.get("servers"))
        return json.loads(Path(out).read_text())["step_seconds"]


def _job_step_seconds(folder: str, tasks: int) -> float | None:
    """Seconds per global batch of an asynchronous parameter-server job, in the part of its timed
    window where every training task was stepping: from the last task's start of timing to the first
    task's end, over the steps all tasks made in between.

    Not the chief's median step: no task waits for another, so the scheduler may give one task more
    than its share of the cores, and the chief's steps say nothing of the others' (CNN at 4
    processes: the chief's median read 128-286 ms across three rounds). Not the whole window either:
    once the fastest task is done the others step alone, on more cores but fewer tasks, a tail a
    long job does not have in proportion (5 steps at 4 processes: the whole window read 2-13% slower
    per global batch than its steady part). The tasks step on equal shares of each global batch, so
    ``tasks`` task-steps make one global batch; a step cut by the steady part's edges counts in
    proportion to its time inside. Windows without per-step ends (older workers): the whole window.
    """
    windows = [json.loads(path.read_text()) for path in Path(folder).glob("window-*.json")]
    if len(windows) != tasks or len({w["steps"] for w in windows}) != 1:
        print(f"  parameter servers: {len(windows)} of {tasks} tasks left a timed window", file=sys.stderr)
        return None
    whole = (max(w["end"] for w in windows) - min(w["start"] for w in windows)) / windows[0]["steps"]
    if not all(len(w.get("ends", ())) == w["steps"] for w in windows):
        return whole
    steady_from, steady_to = max(w["start"] for w in windows), min(w["end"] for w in windows)
    task_steps = sum(
        _steps_done(w["start"], w["ends"], steady_to) - _steps_done(w["start"], w["ends"], steady_from)
        for w in windows
    )
    if steady_to <= steady_from or task_steps <= 0:
        return whole
    return (steady_to - steady_from) / (task_steps / tasks)


def _steps_done(start: float, ends: list[float], moment: float) -> float:
    """How many of a task's steps (the first began at ``start``, each ended at ``ends[i]``) were done
    at ``moment``, the step in progress counted by the share of its time elapsed."""
    begin = start
    for done, end in enumerate(ends):
        if moment < end:
            return done + max(moment - begin, 0.0) / (end - begin) if end > begin else float(done)
        begin = end
    return float(len(ends))


# a profile's measured tables, replica or thread count -> factor or seconds
_FACTOR_TABLES = (
    "contention",
    "slowest_contention",
    "optimizer_contention",
    "in_process",
    "optimizer_by_threads",
)


def _profile_from_json(data: dict) -> ModelProfile:
    """The :class:`ModelProfile` that ``asdict`` wrote (JSON turned int keys and tuples into str/lists)."""
    data = dict(data)
    data["compute"] = {int(k): tuple(v) for k, v in data["compute"].items()}
    for table in _FACTOR_TABLES:
        data[table] = {int(k): float(v) for k, v in data.get(table, {}).items()}
    data["split_backward"] = {int(k): float(v) for k, v in data.get("split_backward", {}).items()}
    data["compute_curve"] = {
        int(k): tuple((float(b), float(t)) for b, t in points)
        for k, points in data.get("compute_curve", {}).items()
    }
    data["layers"] = tuple(LayerProfile(**layer) for layer in data.get("layers", ()))
    data["layer_seconds"] = {
        int(t): {int(n): tuple(float(c) for c in costs) for n, costs in by_batch.items()}
        for t, by_batch in data.get("layer_seconds", {}).items()
    }
    arrival = data.get("gradient_arrival")
    data["gradient_arrival"] = None if arrival is None else tuple(tuple(point) for point in arrival)
    return ModelProfile(**data)


def _factors(profile: ModelProfile) -> str:
    """The measured slowdown factors and optimizer times of ``profile``, for the log."""
    tables = _FACTOR_TABLES
    return "; ".join(
        f"{t} {{{', '.join(f'{k}: {v:.3g}' for k, v in getattr(profile, t).items())}}}" for t in tables
    )


def _grid(profile: ModelProfile, cluster: ClusterModel, global_batch: int, strategies: tuple[str, ...]):
    """The predictions of ``spread plan``'s grid that the suite measures."""
    plan = make_plan(profile, cluster, Options(global_batch=global_batch), strategies)
    for prediction in plan.predictions:
        c = prediction.candidate
        if c.strategy == "pipeline" and c.get("microbatches") not in (
            2 * c.get("stages"),
            4 * c.get("stages"),
        ):
            continue  # two micro-batch counts per stage count keep the grid affordable
        if c.strategy == "parameter_server" and c.get("servers") != 1:
            continue
        yield prediction


def _measure_pass(
    saved: dict, number: int, names: list[str], counts: list[int], calibration: CalibrationProfile, args
) -> None:
    """Profile each family afresh and measure its configurations: one pass over the suite.

    The first pass sets the grid (``spread plan``'s candidates on the first profile); later passes
    measure the same rows again, the families in rotated order and each family's rows reversed on odd
    passes, so no row is always measured at the same point of the run. Each pass predicts from the
    profile it took minutes before its measurements (this VM's speed moves by 20-40% within minutes;
    a profile taken once, 40 minutes before a row's last measurement, shifts a whole family's error).
    A row keeps every pass (``passes``) and reports the median prediction and the median measurement.
    """
    saved["pass_profiles"].append({})
    shift = number % len(names)
    for name in names[shift:] + names[:shift]:
        profile = _profile_workload(name, counts, args.profile_seconds)
        saved["pass_profiles"][number][name] = asdict(profile)
        saved["profiles"].setdefault(name, asdict(profile))
        print(f"pass {number + 1}, {name}: {_factors(profile)}", file=sys.stderr)
        if number == 0:
            todo = [
                (n, prediction)
                for n in counts
                for prediction in _grid(
                    profile,
                    ClusterModel.from_profile(calibration, devices_per_node=n),
                    profile.batch,  # profiled on one global batch
                    tuple(args.strategies.split(",")),
                )
            ]
        else:
            mine = [r for r in saved["rows"] if r["workload"] == name]
            todo = [(r["procs"], _predict_row(r, profile, calibration)) for r in mine]
            if number % 2:
                todo.reverse()
        for n, prediction in todo:
            started = time.perf_counter()
            seconds = _measure(name, prediction.candidate, args.steps, args.timeout)
            measured = {
                "predicted_ms": prediction.step_seconds * 1e3,
                "predicted_rate": prediction.samples_per_second,
                "measured_ms": None if seconds is None else seconds * 1e3,
                "wall_s": time.perf_counter() - started,
            }
            if number == 0:
                c = prediction.candidate
                row = {
                    "workload": name,
                    "procs": n,
                    "global_batch": profile.batch,
                    "config": c.label,
                    "candidate": {"strategy": c.strategy, "devices": c.devices, "settings": list(c.settings)},
                    "passes": [],
                }
                saved["rows"].append(row)
            else:
                (row,) = [r for r in saved["rows"] if (r["workload"], r["procs"], r["config"]) ==
                          (name, n, prediction.candidate.label)]  # fmt: skip
            row["passes"].append(measured)
            row.update(_pass_medians(row["passes"]))
            print(json.dumps({"pass": number + 1, "workload": name, "procs": n, "config": row["config"],
                              **measured}), file=sys.stderr)  # fmt: skip
            if args.json:  # written as it goes: a long run that dies keeps what it measured
                Path(args.json).write_text(json.dumps(saved, indent=1))


def _predict_row(row: dict, profile: ModelProfile, calibration: CalibrationProfile):
    """``row``'s configuration predicted again from ``profile``."""
    cluster = ClusterModel.from_profile(calibration, devices_per_node=row["procs"])
    return predict(_candidate(row), profile, cluster, Options(global_batch=row["global_batch"]))


def _pass_medians(passes: list[dict]) -> dict:
    """A row's prediction, measurement and error over its passes: the median of each.

    The prediction and the measurement are medians taken separately (a failed measurement leaves
    its pass's prediction in); the recommendation ranks by the median predicted rate.
    """
    measured = [p["measured_ms"] for p in passes if p["measured_ms"] is not None]
    predicted_ms = statistics.median(p["predicted_ms"] for p in passes)
    measured_ms = statistics.median(measured) if measured else None
    return {
        "predicted_ms": predicted_ms,
        "predicted_rate": statistics.median(p["predicted_rate"] for p in passes),
        "measured_ms": measured_ms,
        "error": None if measured_ms is None else predicted_ms / measured_ms - 1,
        "wall_s": sum(p["wall_s"] for p in passes),
    }


def _candidate(row: dict) -> Candidate:
    c = row["candidate"]
    return Candidate(c["strategy"], c["devices"], tuple((k, v) for k, v in c["settings"]))


def _cells(rows: list[dict], recommend: dict) -> list[dict]:
    """Per (workload, procs): the recommendation among the measured configurations vs the measured best.

    ``recommend`` maps a row's index to its predicted samples/s. ``close`` also counts a
    recommendation whose measured step is within 5% of the best's (a tie within this machine's noise).
    In a cell that ``--confirm`` measured again, the best is named among the rows it measured again
    (the contenders): the others were more than ``lead`` behind the best in the same pass, and their
    first-pass figure, taken minutes earlier, is not comparable with the later rounds (a machine that
    slowed in between made a row nobody re-measured look best).
    """
    cells = []
    for key in dict.fromkeys((r["workload"], r["procs"]) for r in rows):
        here = [(i, r) for i, r in enumerate(rows) if (r["workload"], r["procs"]) == key and r["measured_ms"]]
        if not here:
            continue
        confirmed = [(i, r) for i, r in here if r.get("confirmed")]
        best = min(confirmed or here, key=lambda t: t[1]["measured_ms"])[1]
        chosen = max(here, key=lambda t: recommend[t[0]])[1]
        paired = _paired_behind(chosen, [r for _, r in confirmed])
        cells.append(
            {
                "workload": key[0],
                "procs": key[1],
                "recommended": chosen["config"],
                "measured_best": best["config"],
                "hit": chosen["config"] == best["config"],
                "close": chosen["measured_ms"] <= 1.05 * best["measured_ms"],
                "best_ms": best["measured_ms"],
                "recommended_ms": chosen["measured_ms"],
                "paired_behind": paired,
                "paired_close": chosen["measured_ms"] <= 1.05 * best["measured_ms"]
                if paired is None
                else paired <= 0.05,
            }
        )
    return cells


def _round_times(row: dict) -> list[float | None] | None:
    """``row``'s step per ``--confirm`` round (None where that round failed), or None if unknown."""
    if "rounds" in row:
        return row["rounds"]
    again = row.get("measurements", [])[1:]  # files from before "rounds" was kept: aligned if none failed
    return again or None


def _paired_behind(chosen: dict, contenders: list[dict]) -> float | None:
    """How far ``chosen`` measured behind the best of ``contenders``, round by round.

    In each ``--confirm`` round every contender ran within a minute of the others, so the ratio of
    two rows' steps in the same round cancels the drift between rounds (this VM's speed moves by
    20-40% within minutes). Per contender the median over rounds of ``chosen / contender``; the
    largest of those, minus one (0 when ``chosen`` is the best). None where rounds cannot be paired.
    """
    mine = _round_times(chosen) if chosen.get("confirmed") else None
    if not mine:
        return None
    behind = 0.0
    for other in contenders:
        theirs = _round_times(other)
        if other is chosen or not theirs or len(theirs) != len(mine):
            continue
        ratios = [a / b for a, b in zip(mine, theirs, strict=True) if a and b]
        if ratios:
            behind = max(behind, statistics.median(ratios) - 1.0)
    return behind


def _report(rows: list[dict], cells: list[dict]) -> None:
    print("\n| workload | procs | configuration | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        measured = "failed" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        error = "" if r["error"] is None else f"{r['error']:+.0%}"
        print(
            f"| {r['workload']} | {r['procs']} | {r['config']} | {r['predicted_ms']:.1f} | {measured} "
            f"| {error} |"
        )
    print(
        "\n| workload | procs | recommended | measured best | same | best ms | recommended ms "
        "| behind the best, paired by round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in cells:
        paired = "" if c["paired_behind"] is None else f"{c['paired_behind']:.0%}"
        print(
            f"| {c['workload']} | {c['procs']} | {c['recommended']} | {c['measured_best']} | "
            f"{'yes' if c['hit'] else ('within 5%' if c['close'] else 'no')} | {c['best_ms']:.0f} | "
            f"{c['recommended_ms']:.0f} | {paired} |"
        )
    _summary(rows, cells)


def _summary(rows: list[dict], cells: list[dict]) -> None:
    """Median absolute error and recommendation quality: over all rows, and over each half of issue
    20's split (``model_families.FITTED``: what the cost model may be adjusted on; ``HELD_OUT``: only
    checked) when the rows include families of both halves."""
    groups = {"all": None}
    names = {r["workload"] for r in rows}
    if names & set(workloads.FITTED) and names & set(workloads.HELD_OUT):
        groups.update(fitted=set(workloads.FITTED), held_out=set(workloads.HELD_OUT))
    print(
        "\n| rows | configurations | median abs. error | within 20% | cells | recommended within 5% of best "
        "| within 5%, paired by round |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, members in groups.items():
        mine = [r for r in rows if members is None or r["workload"] in members]
        here = [c for c in cells if members is None or c["workload"] in members]
        errors = [abs(r["error"]) for r in mine if r["error"] is not None]
        if not errors or not here:
            continue
        close = sum(c["close"] for c in here)
        paired = sum(c["paired_close"] for c in here)
        within = sum(e <= 0.2 for e in errors)
        print(
            f"| {label} | {len(errors)} | {statistics.median(errors):.0%} | {within} of {len(errors)} "
            f"| {len(here)} | {close} of {len(here)} ({close / len(here):.0%}) "
            f"| {paired} of {len(here)} ({paired / len(here):.0%}) |"
        )
    _pass_errors(rows)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    if errors and cells:
        hits = sum(c["hit"] for c in cells)
        close = sum(c["close"] for c in cells)
        print(
            f"\nmedian absolute error {statistics.median(errors):.0%} over {len(errors)} configurations; "
            f"recommendation = measured best in {hits} of {len(cells)} cells ({hits / len(cells):.0%}); "
            f"within 5% of the best in {close} of {len(cells)}"
        )


def _pass_errors(rows: list[dict]) -> None:
    """With ``--passes``: each pass's median absolute error on its own (its prediction against its
    measurement), beside the medians' error: how much one profile and one measurement scatter."""
    count = max((len(r.get("passes", ())) for r in rows), default=0)
    if count < 2:
        return
    cells = []
    for number in range(count):
        errors = [
            abs(p["predicted_ms"] / p["measured_ms"] - 1)
            for r in rows
            if len(r.get("passes", ())) > number and (p := r["passes"][number])["measured_ms"]
        ]
        cells.append(f"pass {number + 1}: {statistics.median(errors):.0%} over {len(errors)}")
    print("\nmedian absolute error of each pass alone: " + "; ".join(cells))


def _profile_workload(name: str, procs: list[int], min_seconds: float) -> ModelProfile:
    """Profile ``name`` in a fresh Python process, as ``spread plan`` profiles one model per run.

    In one process profiling the families one after another, a model profiled after others had run
    at one thread took the process's state from them: the LSTM, profiled last, predicted every
    configuration ~30% faster than it measured (a fresh process's LSTM at 2 threads is slower than
    one whose first steps ran at 1 thread; see docs/results/2026-11-25-planner-families.md).
    """
    with tempfile.TemporaryDirectory(prefix="spread-profile-") as folder:
        out = os.path.join(folder, "profile.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--profile-only", name, "--procs",
               ",".join(map(str, procs)), "--json", out, "--profile-seconds", str(min_seconds)]  # fmt: skip
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=1800)
        return _profile_from_json(json.loads(Path(out).read_text()))


def _profile_here(name: str, procs: list[int], min_seconds: float) -> ModelProfile:
    """Profile ``name`` in this process for a grid of ``procs`` process counts."""
    cores = os.cpu_count() or 1
    model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name)
    x, y = make_batch(global_batch)
    counts = sorted(set(procs))
    return measure_model(
        model,
        loss_fn,
        x,
        y,
        optimizer=make_optimizer(model.parameters()),
        threads=sorted({1, cores, *(max(1, cores // n) for n in counts)}),
        concurrency=[n for n in counts if n > 1],
        min_seconds=min_seconds,
        name=name,
    )


def _replay(
    paths: list[str], profile_seconds: float, reprofile: bool = False, save: str | None = None
) -> None:
    """Predict every measured row of ``paths`` again with the current cost model.

    ``reprofile``: profile the workloads again here first (to try a change to what the profile
    measures); otherwise the saved profiles are used. ``save``: write the rows, with the profiles
    used and the new predictions, to this JSON file (replayable in turn).
    """
    rows: list[dict] = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        calibration = CalibrationProfile.from_json(data["calibration"], source=path)
        profiles = {name: _profile_from_json(p) for name, p in data["profiles"].items()}
        if reprofile:
            for name in profiles:
                procs = [r["procs"] for r in data["rows"] if r["workload"] == name]
                profiles[name] = _profile_workload(name, procs, profile_seconds)
                print(f"{name}: {_factors(profiles[name])}", file=sys.stderr)
        # one profile per pass (--passes): each pass's rows are predicted again from its own profile
        by_pass = [
            {name: _profile_from_json(p) for name, p in taken.items()}
            for taken in data.get("pass_profiles", [])
        ]
        if reprofile or not by_pass:
            by_pass = [profiles]
        first = len(rows)
        for row in data["rows"]:
            predictions = [
                _predict_row(row, taken[row["workload"]], calibration)
                for taken in by_pass
                if row["workload"] in taken
            ]
            predicted_ms = statistics.median(p.step_seconds * 1e3 for p in predictions)
            measured = row["measured_ms"]
            passes = row.get("passes")
            if passes and len(predictions) == len(passes):  # each pass's own error, predicted anew
                passes = [
                    {**taken, "predicted_ms": p.step_seconds * 1e3, "predicted_rate": p.samples_per_second}
                    for taken, p in zip(passes, predictions, strict=True)
                ]
            rows.append(
                {
                    **row,
                    **({"passes": passes} if passes else {}),
                    "predicted_ms": predicted_ms,
                    "predicted_rate": statistics.median(p.samples_per_second for p in predictions),
                    "error": None if measured is None else predicted_ms / measured - 1,
                }
            )
        if save:
            mine = {"rows": rows[first:], "profiles": {n: asdict(p) for n, p in profiles.items()}}
            if len(by_pass) > 1:
                mine["pass_profiles"] = data["pass_profiles"]
            Path(save).write_text(json.dumps({**mine, "calibration": data["calibration"]}, indent=1))
    _report(rows, _cells(rows, {i: r["predicted_rate"] for i, r in enumerate(rows)}))


def _confirm(path: str, rounds: int, steps: int, timeout: float, lead: float = 0.15) -> None:
    """Measure each close cell's contenders again, interleaved, before naming the best.

    One pass measures every configuration once, minutes apart; on a VM whose speed drifts by tens of
    percent within minutes, configurations a few percent apart then rank by when they ran. In each
    (workload, procs) cell, every configuration measured within ``lead`` of the best, and the
    recommended one, run ``rounds`` more times in turn; each such row's measured step becomes the
    median of those interleaved rounds only (the first pass, taken at another time, is kept in
    ``measurements`` for the record but not used: drift would favour whichever row was not
    measured again). Predictions are untouched. Rewrites ``path``.
    """
    data = json.loads(Path(path).read_text())
    rows = data["rows"]
    for key in dict.fromkeys((r["workload"], r["procs"]) for r in rows):
        here = [r for r in rows if (r["workload"], r["procs"]) == key and r["measured_ms"]]
        if len(here) < 2:
            continue
        best = min(r["measured_ms"] for r in here)
        chosen = max(here, key=lambda r: r["predicted_rate"])
        contenders = [r for r in here if r["measured_ms"] <= (1 + lead) * best or r is chosen]
        if len(contenders) < 2:
            continue
        again: dict[int, list[float | None]] = {id(r): [] for r in contenders}
        for r in range(rounds):  # the order rotates, so no row always runs first or after the same one
            shift = r % len(contenders)
            for row in contenders[shift:] + contenders[:shift]:
                seconds = _measure(row["workload"], _candidate(row), steps, timeout)
                again[id(row)].append(None if seconds is None else seconds * 1e3)
        for row in contenders:
            measured = [ms for ms in again[id(row)] if ms is not None]
            if measured:
                row["measurements"] = [row["measured_ms"], *measured]
                row["rounds"] = again[id(row)]  # per round, None where it failed: pairs rows by round
                row["measured_ms"] = statistics.median(measured)
                row["confirmed"] = True
                row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
        print(
            f"{key}: " + ", ".join(f"{r['config']} {r.get('measurements')}" for r in contenders),
            file=sys.stderr,
        )
    Path(path).write_text(json.dumps(data, indent=1))
    _report(rows, _cells(rows, {i: r["predicted_rate"] for i, r in enumerate(rows)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--procs", default="2,3,4")
    parser.add_argument("--profile", default="spread-calibration.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=None, help="also write rows, model profiles and calibration here")
    parser.add_argument("--strategies", default=",".join(sorted(MEASURABLE)), help="subset to measure")
    parser.add_argument("--replay", nargs="+", default=None, help="predict saved --json results again")
    parser.add_argument("--reprofile", action="store_true", help="with --replay: profile the models again")
    parser.add_argument(
        "--confirm",
        default=None,
        help="measure each close cell's leading configurations again (a --json file)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --confirm: extra interleaved rounds")
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="profile and measure every configuration this many times, in rotated order (median)",
    )
    parser.add_argument(
        "--profile-seconds",
        type=float,
        default=PROFILE_SECONDS,
        help="time each model's compute over at least this long (default: spread plan's)",
    )
    parser.add_argument("--profile-only", default=None, help=argparse.SUPPRESS)  # one family, to --json
    args = parser.parse_args()
    tune_this_process()  # as `spread plan` does before it profiles
    if args.profile_only:
        counts = sorted({int(n) for n in args.procs.split(",")})
        Path(args.json).write_text(
            json.dumps(asdict(_profile_here(args.profile_only, counts, args.profile_seconds)))
        )
        return
    if args.confirm:
        _confirm(args.confirm, args.rounds, args.steps, args.timeout)
        return
    if args.replay:
        if args.json and len(args.replay) > 1:
            parser.error("--json with --replay takes one file to replay")
        _replay(args.replay, args.profile_seconds, reprofile=args.reprofile, save=args.json)
        return
    if not os.path.exists(args.profile):
        print(f"calibrating into {args.profile} ...", file=sys.stderr)
        calibrate(args.profile)
    calibration = load_profile(args.profile)
    names = args.workloads.split(",")
    counts = sorted({int(n) for n in args.procs.split(",")})
    saved: dict = {"rows": [], "profiles": {}, "calibration": calibration.to_json(), "pass_profiles": []}
    for number in range(args.passes):
        _measure_pass(saved, number, names, counts, calibration, args)
    print(f"machine: {calibration.machine}; calibration {args.profile} measured {calibration.measured_at}")
    rows = saved["rows"]
    _report(rows, _cells(rows, {i: r["predicted_rate"] for i, r in enumerate(rows)}))


if __name__ == "__main__":
    main()
