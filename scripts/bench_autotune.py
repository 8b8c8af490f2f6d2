"""Does the autotuner's order hold? Re-run its winner and runner-up, interleaved.

    python scripts/bench_autotune.py [--results autotuning_results] [--exps autotuning_exps]
                                     [--metric throughput] [--repeat 3]

Reads a finished `dslaunch --autotuning tune`: its winner and runner-up from reruns.json
(the tuner's judgement of its interleaved re-runs: the runner-up is the best configuration
measurably slower than the winner), or, when the tuner made no re-runs
(--autotuning_repeats 0), the best two trials by the metric. Launches each of them again
`--repeat` times, alternating (A B A B ...), exactly as the tuner did (the experiment's
command from exps_dir, a fresh trial folder each time). Prints every run's metric, the
medians, and whether the winner's median still beats the runner-up's (exit 0 if so, 1 if
not): the check that the tuner's order was not noise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

TRIAL_DIR_VAR = "DSLAUNCH_TRIAL_DIR"
TRIAL_STEPS_VAR = "DSLAUNCH_TRIAL_STEPS"


def trials(results: Path, metric: str):
    """(name, metric value) of every trial that ran to the end, best first."""
    out = []
    for m in results.glob("*/metrics.json"):
        if m.parent.name == "profile_model_info":
            continue
        out.append((m.parent.name, json.loads(m.read_text())[metric]))
    return sorted(out, key=lambda t: t[1], reverse=metric != "latency")


def rerun(exps: Path, results: Path, name: str, metric: str, work: Path) -> float:
    exp = json.loads((exps / f"{name}.json").read_text())
    steps = (results / name / "cmd.txt").read_text().split(f"{TRIAL_STEPS_VAR}=")[1].split()[0]
    work.mkdir(parents=True)
    env = dict(os.environ, **{TRIAL_DIR_VAR: str(work), TRIAL_STEPS_VAR: steps})
    env = {k: v for k, v in env.items() if not k.startswith("DSLAUNCH_AUTOTUNING")}
    cmd = [sys.executable, "-m", "dslaunch.launcher", *exp["command"][1:]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: the re-run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    values = [json.loads(p.read_text())[metric] for p in work.glob("metrics_rank*.json")]
    return min(values) if metric != "latency" else max(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="autotuning_results")
    ap.add_argument("--exps", default="autotuning_exps")
    ap.add_argument("--metric", default="throughput", choices=["throughput", "latency"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results, exps = Path(args.results), Path(args.exps)
    ranked = trials(results, args.metric)
    tuned = dict(ranked)
    judged = results / "reruns.json"
    if judged.is_file():
        verdict = json.loads(judged.read_text())
        if verdict["metric"] != args.metric:
            sys.exit(f"{judged}: the tuner ranked by {verdict['metric']}; pass --metric {verdict['metric']}")
        if not verdict["runner_up"]:
            sys.exit(f"{judged}: no configuration was measurably slower than {verdict['winner']}; nothing to compare")
        a, b = verdict["winner"], verdict["runner_up"]
    elif len(ranked) >= 2:
        a, b = ranked[0][0], ranked[1][0]
    else:
        sys.exit(f"{results}: fewer than two trials ran to the end; nothing to compare")
    a_tuned, b_tuned = tuned[a], tuned[b]
    runs = {a: [], b: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for name in (a, b):
                value = rerun(exps, results, name, args.metric, Path(tmp) / f"{name}-{i}")
                runs[name].append(value)
                print(f"run {i + 1}: {name} {value:.4g}", flush=True)
    med = {n: median(v) for n, v in runs.items()}
    better = med[a] > med[b] if args.metric != "latency" else med[a] < med[b]
    print(f"winner    {a}: tuning run {a_tuned:.4g}, re-run median {med[a]:.4g} {args.metric}")
    print(f"runner-up {b}: tuning run {b_tuned:.4g}, re-run median {med[b]:.4g} {args.metric}")
    print(f"order holds: {'yes' if better else 'no'}")
    return 0 if better else 1


if __name__ == "__main__":
    sys.exit(main())
