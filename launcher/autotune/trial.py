"""One trial: a real `dslaunch` run of the user's script with a generated config.

The trial is launched as a child `dslaunch` with the user's own launcher options, so it
goes through the launcher's one plan, on the same hosts, exactly as a plain launch would;
cmd.txt holds that command, runnable by hand. Its workers run the script under
worker.py, which ends the script cleanly when the engine says the profile steps are done.
Each rank writes metrics_rank<N>.json into the trial's folder (on other hosts: the folder
must be on a shared file system, as DeepSpeed's autotuner also requires); metrics.json
is their aggregate: the slowest rank's throughput and latency, the largest memory.
"""
from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.autotune.space import CHECKPOINTING
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import LaunchOptions

TRIAL_DIR_VAR = "DSLAUNCH_TRIAL_DIR"  # runtime/train/autotuning.py TRIAL_DIR_VAR
TRIAL_STEPS_VAR = "DSLAUNCH_TRIAL_STEPS"  # runtime/train/autotuning.py TRIAL_STEPS_VAR
WORKER_MODULE = "dslaunch.launcher.autotune.worker"
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")  # DeepSpeed's scripts, then the HF Trainer's
HANG_EXIT = 124  # the collective watchdog's exit status (runtime/core/comm/watchdog.EXIT_CODE)
# launcher options a trial never passes on: the tuner owns output, restarts and dry runs
NOT_FOR_TRIALS = {"script", "script_args", "dry_run", "json", "log_dir", "max_restarts", "save_pid"}
_OOM = re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|MemoryError", re.I)
_ERROR_LINE = re.compile(r"(\w*(?:Error|Exception|Interrupt)\b.*|error: .*)$")


# -- script arguments (pure) ---------------------------------------------------------------

def config_arg(script_args: Sequence[str]) -> Tuple[int, str]:
    """(index of the value, config path) of --deepspeed_config / --deepspeed PATH in the script's args."""
    for flag in CONFIG_FLAGS:
        for i, a in enumerate(script_args):
            if a == flag and i + 1 < len(script_args) and not script_args[i + 1].startswith("-"):
                return i + 1, script_args[i + 1]
            if a.startswith(flag + "="):
                return i, a.partition("=")[2]
    raise LaunchConfigError("--autotuning: the script's arguments name no config: pass it as "
                            "--deepspeed_config PATH (or --deepspeed PATH for Hugging Face scripts)")


def with_config(script_args: Sequence[str], path: str, mapped: Mapping[str, Any]) -> List[str]:
    """The script's args with the config replaced by `path` and each arg_mappings option set
    to its value (replaced where the script's args give it, appended otherwise)."""
    args = list(script_args)
    i, _ = config_arg(args)
    args[i] = args[i].partition("=")[0] + "=" + path if "=" in args[i] and args[i].startswith("--") else path
    for option, value in mapped.items():
        value = str(value)
        for j, a in enumerate(args):
            if a == option and j + 1 < len(args):
                args[j + 1] = value
                break
            if a.startswith(option + "="):
                args[j] = f"{option}={value}"
                break
        else:
            args += [option, value]
    return args


def mapped_values(arg_mappings: Mapping[str, str], ds_config: Mapping[str, Any],
                  strict: bool = True, flags: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """arg_mappings {config key: script option} -> {script option: the trial's value}.
    strict=False skips keys the config leaves out (the profile trial's train_batch_size).
    `flags` (Candidate.script_flags) gives the keys a config cannot hold, such as
    activation_checkpointing on or off; a mapped flag with no value is left off."""
    out = {}
    for key, option in arg_mappings.items():
        if key == CHECKPOINTING:
            if flags and key in flags:
                out[option] = flags[key]
            continue
        node: Any = ds_config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                if not strict:
                    break
                raise LaunchConfigError(f"autotuning.arg_mappings: {key!r} is not a key of the tuned config")
            node = node[part]
        else:
            out[option] = node
    return out


def launcher_argv(opts: LaunchOptions, skip=NOT_FOR_TRIALS) -> List[str]:
    """The user's launcher options as `dslaunch` options, less those in `skip` (a trial's:
    NOT_FOR_TRIALS; the training command after tuning keeps --log_dir, --max_restarts...)."""
    default = LaunchOptions(script="x")
    argv: List[str] = []
    for f in fields(LaunchOptions):
        value = getattr(opts, f.name)
        if f.name in skip or value == getattr(default, f.name):
            continue
        flag = "--" + f.name
        if isinstance(value, bool):
            argv.append(flag)
        elif isinstance(value, tuple):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


# -- outcome (pure) ------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str  # "ok", "crashed", "out of memory", "hung", "timed out"
    metrics: Optional[Dict[str, Any]]
    reason: str
    seconds: float


def aggregate(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    first = dict(per_rank[0])
    limits = [m["memory_limit_bytes"] for m in per_rank if m.get("memory_limit_bytes")]
    first.update(
        ranks=len(per_rank), throughput=min(m["throughput"] for m in per_rank),
        latency=max(m["latency"] for m in per_rank), measured_bytes=max(m["measured_bytes"] for m in per_rank),
        memory_limit_bytes=min(limits) if limits else None,
        activation_bytes_per_sample=max(m["activation_bytes_per_sample"] for m in per_rank))
    most = max(per_rank, key=lambda m: m["activation_bytes_per_sample"])  # its parts, with its total
    for key in ("forward_saved_bytes_per_sample", "checkpoint_input_bytes_per_sample",
                "checkpoint_segment_bytes_per_sample"):
        if key in most:
            first[key] = most[key]
    first.pop("rank", None)
    return first


def error_line(stderr_text: str) -> str:
    """The one line that says what went wrong: the last exception line a worker printed,
    else the launcher's own last line."""
    lines = [ln.strip() for ln in stderr_text.splitlines() if ln.strip()]
    first = re.search(r"^dslaunch: rank (\d+) failed first", stderr_text, re.M)
    if first:  # that rank's own lines, not its peers' follow-on errors
        own = [ln for ln in lines if ln.startswith(f"[rank {first.group(1)}]")]
        lines = own or lines
    for ln in reversed(lines):
        m = _ERROR_LINE.search(re.sub(r"^\[[^\]]*\]\s*", "", ln))
        if m and not ln.startswith("dslaunch:"):
            return m.group(1)[:300]
    return (lines[-1] if lines else "no output")[:300]


def classify(rc: int, timed_out: bool, stderr_text: str, metrics: Optional[Dict[str, Any]], end_step: int,
             seconds: float) -> Outcome:
    if metrics is not None and rc == 0:
        return Outcome("ok", metrics, "", seconds)
    if timed_out:
        return Outcome("timed out", None, f"stopped after {seconds:.0f} s: the --autotuning_budget ran out", seconds)
    if _OOM.search(stderr_text) or rc == 137:
        why = error_line(stderr_text) if _OOM.search(stderr_text) else "killed by SIGKILL (the kernel's OOM killer?)"
        return Outcome("out of memory", None, why, seconds)
    if rc == HANG_EXIT:
        hung = [ln for ln in stderr_text.splitlines() if "watchdog" in ln or " is in " in ln]
        return Outcome("hung", None, (hung[-1].strip() if hung else "the collective watchdog ended it")[:300],
                       seconds)
    if rc == 0:
        return Outcome("crashed", None, f"the script ended before end_profile_step {end_step} (train longer, or "
                                        "lower end_profile_step)", seconds)
    return Outcome("crashed", None, f"exit code {rc}: {error_line(stderr_text)}", seconds)


# -- the launch (plumbing) -----------------------------------------------------------------

@dataclass
class TrialLauncher:
    """How every trial of one tuning run is launched."""

    opts: LaunchOptions
    environ: Mapping[str, str]
    start_step: int
    end_step: int
    arg_mappings: Mapping[str, str]

    def command(self, exp_dir: Path, ds_config: Mapping[str, Any],
                flags: Optional[Mapping[str, str]] = None) -> List[str]:
        args = with_config(self.opts.script_args, str(exp_dir / "ds_config.json"),
                           mapped_values(self.arg_mappings, ds_config, strict="train_batch_size" in ds_config,
                                         flags=flags))
        target = ["-m", self.opts.script] if self.opts.module else [self.opts.script]
        return ["dslaunch", *launcher_argv(self.opts), "--export", TRIAL_DIR_VAR, "--export", TRIAL_STEPS_VAR,
                "--module", WORKER_MODULE, *target, *args]

    def env(self, exp_dir: Path) -> Dict[str, str]:
        # DSLAUNCH_AUTOTUNING* would make the child dslaunch tune again (click reads DSLAUNCH_<OPTION>)
        env = {k: v for k, v in self.environ.items() if not k.startswith("DSLAUNCH_AUTOTUNING")}
        env[TRIAL_DIR_VAR] = str(exp_dir)
        env[TRIAL_STEPS_VAR] = f"{self.start_step}:{self.end_step}"
        return env

    def run(self, exp_dir: Path, ds_config: Mapping[str, Any], timeout: float,
            flags: Optional[Mapping[str, str]] = None) -> Outcome:
        exp_dir.mkdir(parents=True, exist_ok=True)
        for old in [*exp_dir.glob("metrics*.json"), *exp_dir.glob("outcome.json")]:
            old.unlink()
        (exp_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        cmd = self.command(exp_dir, ds_config, flags)
        env = self.env(exp_dir)
        (exp_dir / "cmd.txt").write_text(
            f"{TRIAL_DIR_VAR}={shlex.quote(env[TRIAL_DIR_VAR])} {TRIAL_STEPS_VAR}={env[TRIAL_STEPS_VAR]} "
            f"{shlex.join(cmd)}\n")
        start = time.monotonic()
        timed_out = False
        with open(exp_dir / "stdout.log", "wb") as out, open(exp_dir / "stderr.log", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "dslaunch.launcher", *cmd[1:]], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            try:
                rc = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.send_signal(signal.SIGTERM)  # the child launcher tears its workers down
                try:
                    rc = proc.wait(timeout=self.opts.kill_grace + 10)
                except subprocess.TimeoutExpired:
                    proc.kill()  # its watchdog process ends the workers
                    rc = proc.wait()
            except BaseException:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                raise
        seconds = time.monotonic() - start
        per_rank = [json.loads(p.read_text()) for p in sorted(exp_dir.glob("metrics_rank*.json"))]
        metrics = aggregate(per_rank) if per_rank else None
        if metrics is not None:
            (exp_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        stderr_text = (exp_dir / "stderr.log").read_text(errors="replace")
        out = classify(rc, timed_out, stderr_text, metrics, self.end_step, seconds)
        (exp_dir / "outcome.json").write_text(json.dumps(asdict(out), indent=2) + "\n")
        return out
