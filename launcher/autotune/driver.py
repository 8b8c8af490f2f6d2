"""The tuning loop: profile once, prune, try candidates, write the results; `run` then trains.

1. A profile trial (the user's config at ZeRO stage 0, micro-batch 1, no accumulation;
   with activation checkpointing on when it is tuned) measures the parameter count, the
   activation bytes per sample (with and without checkpointing: memory.activation_model),
   the data-parallel size and the memory one rank may use (device free memory, or the
   host's share on CPU; --autotuning_memory_limit overrides it).
2. The space (space.py) is built; the memory model (memory.py) prunes every candidate
   predicted not to fit, before any launch; per stage, num_tuning_micro_batch_sizes
   micro-batch sizes are kept, spread over those that fit.
3. The tuner proposes candidates until none are left, tuner_num_trials ran, early
   stopping fires or the --autotuning_budget is spent. A trial that fails is recorded with
   its one-line reason and tuning goes on. With `fast` false, the bucket sizes around the
   best candidate are tried next (space.bucket_variants), under the same bounds.
4. The best CONFIRM_TOP that ran are re-measured --autotuning_repeats times, interleaved
   (A B C A B C ...), each re-run a fresh launch in <exp>/rerun<i>/; ranking.judge() picks
   the winner by their medians and calls a difference real only when the re-runs' ranges
   do not overlap (a tie within noise goes to the lower predicted memory). One tuning run
   per configuration is not enough to call one the fastest on a loaded machine.
5. results_dir gets summary.txt, reruns.json (the re-runs and the judgement),
   ds_config_optimal.json and cmd_optimal.txt; every trial its own folder (trial.py);
   exps_dir one JSON per experiment, as DeepSpeed writes.
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
from dslaunch.launcher.autotune.memory import ModelInfo, Precision, activation_model, mib, predict_bytes
from dslaunch.launcher.autotune.ranking import NOT_TRIED, OK, PRUNED, TrialRecord
from dslaunch.launcher.autotune.space import (CHECKPOINTING, Candidate, bucket_variants, build_space,
                                              checkpointing_options, spread, stages_of, tp_degrees)
from dslaunch.launcher.autotune.trial import (Outcome, TrialLauncher, config_arg, launcher_argv, mapped_values,
                                              with_config)
from dslaunch.launcher.autotune.tuners import TUNERS, EarlyStopping
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import LaunchOptions

DEFAULT_BUDGET_S = 3600.0
DEFAULT_REPEATS = 3
CONFIRM_TOP = 3  # how many of the best tuning runs are re-measured
PROFILE_EXP = "profile_model_info"


class TuningFailed(LaunchConfigError):
    """Tuning could not go on (the profile trial failed): one line, exit 1, not a usage error."""

    exit_code = 1


@dataclass
class Settings:
    mode: str  # "tune" or "run"
    budget_s: float = DEFAULT_BUDGET_S
    memory_limit: Optional[int] = None  # bytes per rank; None: measured by the profile trial
    repeats: int = DEFAULT_REPEATS  # interleaved re-runs of the best CONFIRM_TOP; 0: none


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
    # micro-batch sizes are sampled per tp degree, stage and checkpointing choice: checkpointing
    # on is what lets the larger ones fit
    def group_of(c):
        return c.tp, c.stage, c.activation_checkpointing is True

    for group in sorted({group_of(c) for c in fits}):
        sizes = sorted({c.micro_batch for c in fits if group_of(c) == group})
        chosen = set(spread(sizes, at.num_tuning_micro_batch_sizes))
        for c in fits:
            if group_of(c) != group:
                continue
            if c.micro_batch in chosen:
                kept.append(c)
            else:
                records.append(TrialRecord(c, NOT_TRIED, predicted_bytes=predict_bytes(c, info, prec),
                                           reason=f"not sampled (num_tuning_micro_batch_sizes "
                                                  f"{at.num_tuning_micro_batch_sizes})"))
    return kept, records


def writable_dir(folder: Path, what: str) -> None:
    """Make `folder` and prove a file can be created in it, before the first trial: a folder
    such as /proc/self (or a file's name) would otherwise fail mid-tuning with a traceback.
    A folder other users can write is refused (private_files.py): trials write logs and
    configs into it, and a link planted there would be written through."""
    from dslaunch.launcher.private_files import open_shared_dir

    os.close(open_shared_dir(str(folder), what))
    probe = folder / f".dslaunch-probe-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        raise LaunchConfigError(f"{what} {folder}: cannot write there ({exc.strerror or exc})") from None


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
        if section is not None and not isinstance(section, dict):  # else its keys would be ignored unread
            raise LaunchConfigError(f"{self.config_path}: autotuning: must be a JSON object of keys and values, "
                                    f"not a {type(section).__name__}")
        if isinstance(section, dict) and section.get("enabled") is False:
            raise LaunchConfigError(f"{self.config_path}: autotuning.enabled is false; set it true to tune")
        self.at = AutotuningConfig.from_dict(section)
        self.results = Path(self.at.results_dir)
        self.exps = Path(self.at.exps_dir)
        self.launcher = TrialLauncher(opts, environ, self.at.start_profile_step, self.at.end_profile_step,
                                      self.at.arg_mappings)
        self.deadline = time.monotonic() + settings.budget_s
        # checked now, before the profile trial, rather than after it
        stages_of(self.user)
        for key in self.at.arg_mappings:
            if key != CHECKPOINTING:
                mapped_values({key: "-x"}, Candidate(0, 1, 1).ds_config(self.user, 1))
        self.best: Optional[Candidate] = None
        self.tps: List[int] = [1]

    # -- one experiment, reused when overwrite is false and it already ran -----------------
    def _trial(self, name: str, ds_config: dict, flags: Optional[Dict[str, str]] = None,
               experiment: bool = True) -> Outcome:
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
        if experiment:  # (a re-run is the experiment's own command again)
            self.exps.mkdir(parents=True, exist_ok=True)
            (self.exps / f"{name}.json").write_text(json.dumps(
                {"name": name, "ds_config": ds_config, "command": self.launcher.command(exp_dir, ds_config, flags)},
                indent=2))
        return self.launcher.run(exp_dir, ds_config, timeout=self.deadline - time.monotonic(), flags=flags)

    def profile(self) -> ModelInfo:
        probe = Candidate(0, 1, 1, activation_checkpointing=checkpointing_options(self.at)[-1])
        cfg = probe.ds_config(self.user, 1)
        del cfg["train_batch_size"]  # the runtime derives it from the ranks: their count is not known yet
        ckpt = ", activation checkpointing on" if probe.activation_checkpointing else ""
        _say(f"profiling the model ({PROFILE_EXP}: ZeRO stage 0, micro-batch 1{ckpt})")
        out = self._trial(PROFILE_EXP, cfg, probe.script_flags())
        if out.status != OK:
            raise TuningFailed(f"the profile trial {out.status}: {out.reason} "
                              f"(see {self.results / PROFILE_EXP}/stderr.log)")
        m = out.metrics
        limit = self.settings.memory_limit or m.get("memory_limit_bytes")
        if not limit:
            raise TuningFailed("autotuning: the memory per rank could not be measured here; "
                               "give --autotuning_memory_limit")
        with_ckpt = without = None
        if probe.activation_checkpointing:
            with_ckpt, without = activation_model(m["forward_saved_bytes_per_sample"],
                                                  m["checkpoint_input_bytes_per_sample"],
                                                  m["checkpoint_segment_bytes_per_sample"])
        autotp = m.get("autotp") or {}
        return ModelInfo(int(m["params"]), float(m["activation_bytes_per_sample"]), int(m["dp"]), int(limit),
                         m["device"] == "cpu", with_ckpt, without,
                         {int(d): int(n) for d, n in (autotp.get("split") or {}).items()}, autotp.get("refused", ""))

    def tune(self) -> int:
        start = time.monotonic()
        for key, folder in (("exps_dir", self.exps), ("results_dir", self.results)):
            writable_dir(folder, f"autotuning.{key}")
        info = self.profile()
        prec = Precision.of(self.user)
        self.tps = tp_degrees(self.user, sorted(info.tp_split_params), info.tp_refusal)
        space = build_space(self.user, self.at, info.dp, self.tps)
        todo, records = plan_candidates(space, info, prec, self.at)
        _say(f"{len(space)} configurations: {len(todo)} to try, "
             f"{sum(r.status == PRUNED for r in records)} pruned by the memory model "
             f"(limit {mib(info.memory_limit)} per rank, {info.params} parameters, "
             f"{mib(info.activation_bytes_per_sample)} of activations per sample)")
        ran: List[TrialRecord] = []
        untried, stop_reason = self._sweep(todo, TUNERS[self.at.tuner_type](), ran, info, prec)
        top = ranking.best(ran, self.at.metric)
        if not self.at.fast and top is not None and not untried and not stop_reason:
            variants = bucket_variants(top.candidate, self.user)
            _say(f"bucket sizes around {top.name}: {len(variants)} more configuration(s)")
            untried, stop_reason = self._sweep(variants, TUNERS["gridsearch"](), ran, info, prec,
                                               best=ranking.score(self.at.metric, top.value))
        verdict = self._rerun_best(ran, info) if self.settings.repeats else None
        records += ran + [TrialRecord(c, NOT_TRIED, predicted_bytes=predict_bytes(c, info, prec), reason=stop_reason)
                          for c in untried]
        return self._write(records, info, time.monotonic() - start, verdict)

    def _rerun_best(self, ran: List[TrialRecord], info: ModelInfo) -> Optional[ranking.Verdict]:
        """Re-measure the best CONFIRM_TOP interleaved and judge them (ranking.judge)."""
        metric, repeats = self.at.metric, self.settings.repeats
        top = [r for r in ranking.ranked(ran, metric) if r.status == OK][:CONFIRM_TOP]
        if len(top) < 2:
            _say("fewer than two trials ran to the end: nothing to re-measure")
            return None
        _say(f"re-measuring the best {len(top)} interleaved, {repeats} time(s) each: "
             f"{', '.join(r.name for r in top)}")
        runs: Dict[str, List[float]] = {r.name: [] for r in top}
        dropped: Dict[str, str] = {}
        order = [(i, r) for i in range(1, repeats + 1) for r in top]  # round by round: A B C A B C ...
        for i, r in order:
            if r.name in dropped:
                continue
            if time.monotonic() >= self.deadline:
                _say(f"the --autotuning_budget of {self.settings.budget_s:g} s ran out during the re-runs")
                break
            out = self._trial(f"{r.name}/rerun{i}", r.candidate.ds_config(self.user, info.dp),
                              r.candidate.script_flags(), experiment=False)
            if out.status == OK:
                runs[r.name].append(out.metrics[metric])
                shown = f"{runs[r.name][-1]:.4g} {ranking.UNITS[metric]}"
            else:
                dropped[r.name] = f"re-run {i} {out.status}: {out.reason}"
                del runs[r.name]
                shown = dropped[r.name]
            _say(f"[re-run {i}/{repeats}] {r.name}: {shown}")
        rounds = min((len(v) for v in runs.values()), default=0)  # complete rounds only: alike for all
        if len(runs) < 2 or rounds < 2:  # one run each has no spread to tell noise from a difference
            _say("too few complete rounds of re-runs to judge: ranked by the tuning runs alone")
            return None
        verdict = ranking.judge({n: v[:rounds] for n, v in runs.items()}, metric,
                                {r.name: r.predicted_bytes or 0 for r in top})
        verdict.dropped = dropped
        (self.results / "reruns.json").write_text(json.dumps(
            {"metric": metric, "winner": verdict.winner, "runner_up": verdict.runner_up, "tied": verdict.tied,
             "runs": verdict.runs, "medians": verdict.medians, "dropped": dropped}, indent=2) + "\n")
        return verdict

    def _sweep(self, todo: List[Candidate], tuner, ran: List[TrialRecord], info: ModelInfo, prec: Precision,
               best: Optional[float] = None) -> Tuple[List[Candidate], str]:
        """Try `todo` in the tuner's order, appending to `ran`, until done or a bound stops it:
        (the candidates left untried, why they were)."""
        stopper = EarlyStopping(self.at.tuner_early_stopping)
        stopper.best = best
        scores: Dict[Candidate, Optional[float]] = {}
        untried = list(todo)
        while untried:
            if len(ran) >= self.at.tuner_num_trials:
                return untried, f"tuner_num_trials {self.at.tuner_num_trials} reached"
            if time.monotonic() >= self.deadline:
                return untried, f"the --autotuning_budget of {self.settings.budget_s:g} s ran out"
            c = tuner.propose(untried, scores)
            untried.remove(c)
            cfg = c.ds_config(self.user, info.dp)
            out = self._trial(c.name, cfg, c.script_flags())
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
                return untried, (f"early stopping: {self.at.tuner_early_stopping} trial(s) in a row did not "
                                 "improve the best")
        return untried, ""

    def _write(self, records: List[TrialRecord], info: ModelInfo, seconds: float,
               verdict: Optional[ranking.Verdict] = None) -> int:
        header = [f"dslaunch autotuning: metric {self.at.metric}, tuner {self.at.tuner_type}, "
                  f"{sum(r.status not in (PRUNED, NOT_TRIED) for r in records)} trial(s) in {seconds:.0f} s",
                  f"model: {info.params} parameters, {mib(info.activation_bytes_per_sample)} activations per "
                  f"sample, {info.dp} data-parallel rank(s), memory limit {mib(info.memory_limit)} per rank"]
        header.append(self._tp_line(info))
        if info.checkpointed_bytes_per_sample is not None:
            header.append(f"activation checkpointing (measured in {PROFILE_EXP}): "
                          f"{mib(info.checkpointed_bytes_per_sample)} per sample with it on, "
                          f"{mib(info.plain_bytes_per_sample)} with it off")
        if verdict is None:
            (self.results / "reruns.json").unlink(missing_ok=True)  # an earlier run's
        text = ranking.summary(records, self.at.metric, header, verdict)
        (self.results / "summary.txt").write_text(text)
        top = ranking.best(records, self.at.metric)
        if verdict is not None:
            top = next(r for r in records if r.name == verdict.winner)
        if top is None:
            _say(f"no configuration ran to the end; see {self.results / 'summary.txt'}")
            return 1
        self.best = top.candidate
        cfg = top.candidate.ds_config(self.user, info.dp)
        (self.results / "ds_config_optimal.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (self.results / "cmd_optimal.txt").write_text(shlex.join(self.optimal_command()) + "\n")
        value = verdict.medians[top.name] if verdict is not None else top.value
        _say(f"best: {top.name} ({value:.4g} {ranking.UNITS[self.at.metric]}); results in {self.results}/")
        return 0

    def _tp_line(self, info: ModelInfo) -> str:
        where = f"AutoTP, asked in {PROFILE_EXP}"
        split = ", ".join(f"degree {d} splits {info.tp_split_params[d]} of {info.params} parameters"
                          for d in self.tps if d > 1 and d in info.tp_split_params)
        if len(self.tps) > 1:
            return f"tensor parallel ({where}): degrees {', '.join(map(str, self.tps))} tuned; {split}"
        if self.tps != [1]:
            return f"tensor parallel: degree {self.tps[0]} (fixed by tensor_parallel.autotp_size)" + \
                (f"; {split}" if split else "")
        why = f": {info.tp_refusal}" if info.tp_refusal else ""
        return f"tensor parallel ({where}): degree 1 only{why}"

    def optimal_args(self) -> List[str]:
        path = self.results / "ds_config_optimal.json"
        cfg = json.loads(path.read_text())
        flags = self.best.script_flags() if self.best is not None else None
        return with_config(self.opts.script_args, str(path), mapped_values(self.at.arg_mappings, cfg, flags=flags))

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
