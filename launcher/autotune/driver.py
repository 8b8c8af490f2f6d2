"""The tuning loop: profile once, prune, try candidates, write the results; `run` then trains.

1. A profile trial (the user's config at ZeRO stage 0, micro-batch 1, no accumulation)
   measures the parameter count, the activation bytes per sample, the data-parallel size
   and the memory one rank may use (device free memory, or the host's share on CPU;
   --autotuning_memory_limit overrides it).
2. The space (space.py) is built; the memory model (memory.py) prunes every candidate
   predicted not to fit, before any launch; per stage, num_tuning_micro_batch_sizes
   micro-batch sizes are kept, spread over those that fit.
3. The tuner proposes candidates until none are left, tuner_num_trials ran, early
   stopping fires or the --autotuning_budget is spent. A trial that fails is recorded with
   its one-line reason and tuning goes on.
4. results_dir gets summary.txt, ds_config_optimal.json and cmd_optimal.txt; every trial
   its own folder (trial.py); exps_dir one JSON per experiment, as DeepSpeed writes.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dslaunch.launcher.autotune import ranking
from dslaunch.launcher.autotune.config import AutotuningConfig, load_user_config
from dslaunch.launcher.autotune.memory import ModelInfo, Precision, mib, predict_bytes
from dslaunch.launcher.autotune.ranking import NOT_TRIED, OK, PRUNED, TrialRecord
from dslaunch.launcher.autotune.space import Candidate, build_space, spread, stages_of
from dslaunch.launcher.autotune.trial import (Outcome, TrialLauncher, config_arg, launcher_argv, mapped_values,
                                              with_config)
from dslaunch.launcher.autotune.tuners import TUNERS, EarlyStopping
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import LaunchOptions

DEFAULT_BUDGET_S = 3600.0
PROFILE_EXP = "profile_model_info"


class TuningFailed(LaunchConfigError):
    """Tuning could not go on (the profile trial failed): one line, exit 1, not a usage error."""

    exit_code = 1


@dataclass
class Settings:
    mode: str  # "tune" or "run"
    budget_s: float = DEFAULT_BUDGET_S
    memory_limit: Optional[int] = None  # bytes per rank; None: measured by the profile trial


def _say(text: str) -> None:
    sys.stderr.write(f"dslaunch: autotuning: {text}\n")
    sys.stderr.flush()


def plan_candidates(space: List[Candidate], info: ModelInfo, prec: Precision,
                    at: AutotuningConfig) -> Tuple[List[Candidate], List[TrialRecord]]:
    """(candidates to tune, records of those pruned or not sampled), pure."""
    kept, records = [], []
    fits = []
    for c in space:
        need = predict_bytes(c, info, prec)
        if need > info.memory_limit:
            records.append(TrialRecord(c, PRUNED, predicted_bytes=need,
                                       reason=f"predicted {mib(need)} > limit {mib(info.memory_limit)} per rank"))
        else:
            fits.append(c)
    for stage in sorted({c.stage for c in fits}):
        sizes = sorted({c.micro_batch for c in fits if c.stage == stage})
        chosen = set(spread(sizes, at.num_tuning_micro_batch_sizes))
        for c in fits:
            if c.stage != stage:
                continue
            if c.micro_batch in chosen:
                kept.append(c)
            else:
                records.append(TrialRecord(c, NOT_TRIED, predicted_bytes=predict_bytes(c, info, prec),
                                           reason=f"not sampled (num_tuning_micro_batch_sizes "
                                                  f"{at.num_tuning_micro_batch_sizes})"))
    return kept, records


class Tuning:
    def __init__(self, opts: LaunchOptions, settings: Settings, environ: Dict[str, str]):
        if opts.no_python:
            raise LaunchConfigError("--autotuning needs a Python script: a trial runs it under the trial wrapper "
                                    "(drop --no_python)")
        if opts.dry_run:
            raise LaunchConfigError("--autotuning with --dry_run: not supported (a dry run starts nothing; "
                                    "tuning must run trials)")
        self.opts, self.settings, self.environ = opts, settings, environ
        _, self.config_path = config_arg(opts.script_args)
        self.user = load_user_config(self.config_path)
        section = self.user.get("autotuning")
        if isinstance(section, dict) and section.get("enabled") is False:
            raise LaunchConfigError(f"{self.config_path}: autotuning.enabled is false; set it true to tune")
        self.at = AutotuningConfig.from_dict(section if isinstance(section, dict) else None)
        self.results = Path(self.at.results_dir)
        self.exps = Path(self.at.exps_dir)
        self.launcher = TrialLauncher(opts, environ, self.at.start_profile_step, self.at.end_profile_step,
                                      self.at.arg_mappings)
        self.deadline = time.monotonic() + settings.budget_s
        # checked now, before the profile trial, rather than after it
        stages_of(self.user)
        for key in self.at.arg_mappings:
            mapped_values({key: "-x"}, Candidate(0, 1, 1).ds_config(self.user, 1))

    # -- one experiment, reused when overwrite is false and it already ran -----------------
    def _trial(self, name: str, ds_config: dict) -> Outcome:
        exp_dir = (self.results / name).resolve()
        if not self.at.overwrite:
            try:
                same = json.loads((exp_dir / "ds_config.json").read_text()) == ds_config
                previous = Outcome(**json.loads((exp_dir / "outcome.json").read_text()))
            except (OSError, ValueError, TypeError):
                same = False
            if same:
                _say(f"{name}: reusing its earlier outcome (overwrite is false)")
                return previous
        self.exps.mkdir(parents=True, exist_ok=True)
        (self.exps / f"{name}.json").write_text(json.dumps(
            {"name": name, "ds_config": ds_config, "command": self.launcher.command(exp_dir, ds_config)}, indent=2))
        return self.launcher.run(exp_dir, ds_config, timeout=self.deadline - time.monotonic())

    def profile(self) -> ModelInfo:
        cfg = Candidate(0, 1, 1).ds_config(self.user, 1)
        del cfg["train_batch_size"]  # the runtime derives it from the ranks: their count is not known yet
        _say(f"profiling the model ({PROFILE_EXP}: ZeRO stage 0, micro-batch 1)")
        out = self._trial(PROFILE_EXP, cfg)
        if out.status != OK:
            raise TuningFailed(f"the profile trial {out.status}: {out.reason} "
                              f"(see {self.results / PROFILE_EXP}/stderr.log)")
        m = out.metrics
        limit = self.settings.memory_limit or m.get("memory_limit_bytes")
        if not limit:
            raise TuningFailed("autotuning: the memory per rank could not be measured here; "
                               "give --autotuning_memory_limit")
        return ModelInfo(int(m["params"]), float(m["activation_bytes_per_sample"]), int(m["dp"]), int(limit),
                         m["device"] == "cpu")

    def tune(self) -> int:
        start = time.monotonic()
        self.results.mkdir(parents=True, exist_ok=True)
        info = self.profile()
        prec = Precision.of(self.user)
        space = build_space(self.user, self.at, info.dp)
        todo, records = plan_candidates(space, info, prec, self.at)
        _say(f"{len(space)} configurations: {len(todo)} to try, "
             f"{sum(r.status == PRUNED for r in records)} pruned by the memory model "
             f"(limit {mib(info.memory_limit)} per rank, {info.params} parameters, "
             f"{mib(info.activation_bytes_per_sample)} of activations per sample)")
        tuner = TUNERS[self.at.tuner_type]()
        stopper = EarlyStopping(self.at.tuner_early_stopping)
        scores: Dict[Candidate, Optional[float]] = {}
        ran: List[TrialRecord] = []
        stop_reason = ""
        untried = list(todo)
        while untried:
            if len(ran) >= self.at.tuner_num_trials:
                stop_reason = f"tuner_num_trials {self.at.tuner_num_trials} reached"
                break
            if time.monotonic() >= self.deadline:
                stop_reason = f"the --autotuning_budget of {self.settings.budget_s:g} s ran out"
                break
            c = tuner.propose(untried, scores)
            untried.remove(c)
            cfg = c.ds_config(self.user, info.dp)
            out = self._trial(c.name, cfg)
            m = out.metrics or {}
            rec = TrialRecord(c, out.status, m.get(self.at.metric) if out.status == OK else None,
                              predict_bytes(c, info, prec), m.get("measured_bytes"), out.reason, out.seconds)
            ran.append(rec)
            scores[c] = ranking.score(self.at.metric, rec.value)
            top = ranking.best(ran, self.at.metric)
            shown = f"{rec.value:.4g} {ranking.UNITS[self.at.metric]}" if rec.status == OK else \
                f"{rec.status}: {rec.reason}"
            best_txt = f"{top.name} ({top.value:.4g})" if top else "none yet"
            _say(f"[{len(ran)} done, {len(untried)} left] {c.name}: {shown}; best so far {best_txt}")
            if stopper.observe(scores[c]) and untried:
                stop_reason = (f"early stopping: {self.at.tuner_early_stopping} trial(s) in a row did not improve "
                               "the best")
                break
        records += ran + [TrialRecord(c, NOT_TRIED, predicted_bytes=predict_bytes(c, info, prec), reason=stop_reason)
                          for c in untried]
        return self._write(records, info, time.monotonic() - start)

    def _write(self, records: List[TrialRecord], info: ModelInfo, seconds: float) -> int:
        header = [f"dslaunch autotuning: metric {self.at.metric}, tuner {self.at.tuner_type}, "
                  f"{sum(r.status not in (PRUNED, NOT_TRIED) for r in records)} trial(s) in {seconds:.0f} s",
                  f"model: {info.params} parameters, {mib(info.activation_bytes_per_sample)} activations per "
                  f"sample, {info.dp} data-parallel rank(s), memory limit {mib(info.memory_limit)} per rank"]
        text = ranking.summary(records, self.at.metric, header)
        (self.results / "summary.txt").write_text(text)
        top = ranking.best(records, self.at.metric)
        if top is None:
            _say(f"no configuration ran to the end; see {self.results / 'summary.txt'}")
            return 1
        cfg = top.candidate.ds_config(self.user, info.dp)
        (self.results / "ds_config_optimal.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (self.results / "cmd_optimal.txt").write_text(shlex.join(self.optimal_command()) + "\n")
        _say(f"best: {top.name} ({top.value:.4g} {ranking.UNITS[self.at.metric]}); results in {self.results}/")
        return 0

    def optimal_args(self) -> List[str]:
        path = self.results / "ds_config_optimal.json"
        cfg = json.loads(path.read_text())
        return with_config(self.opts.script_args, str(path), mapped_values(self.at.arg_mappings, cfg))

    def optimal_command(self) -> List[str]:
        target = ["--module", self.opts.script] if self.opts.module else [self.opts.script]
        keep = launcher_argv(self.opts, skip={"script", "script_args", "dry_run", "json"})
        return ["dslaunch", *keep, *target, *self.optimal_args()]


def autotune(opts: LaunchOptions, settings: Settings) -> int:
    tuning = Tuning(opts, settings, dict(os.environ))
    code = tuning.tune()
    if code != 0 or settings.mode == "tune":
        return code
    from dslaunch.launcher.launch import launch

    _say(f"training with {tuning.results / 'ds_config_optimal.json'}")
    return launch(replace(opts, script_args=tuple(tuning.optimal_args())))
