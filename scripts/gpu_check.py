#!/usr/bin/env python3
"""The GPU check: every GPU path of dslaunch proved and measured in one run, beside torch and
DeepSpeed, on a bare machine with an NVIDIA GPU and no network. Started by scripts/gpu_check.sh,
which makes dslaunch (and carried wheels) importable first; see that file for the usage.

Steps, in this order, each in its own process group under its own time limit (a step that
fails or runs out of time leaves the others' figures):
  a  env      nvidia-smi, torch and CUDA versions, the card's measured ceilings (a bf16 matrix
              product and a device copy), and `dslaunch build-ops --cuda` timed cold; DeepSpeed's
              FusedAdam and CPUAdam ops are built cold beside it when DeepSpeed is importable
  b  tests    the `gpu`-marked tests
  c  adam     bench_adam.py --cuda-only: FusedAdam against torch.optim.AdamW(fused=True) (and
              DeepSpeed's FusedAdam) at 100M parameters in 1 and 200 tensors, bf16 and fp32
  d  gptlite  one GPU, one rank, GPT-lite of about 350M parameters in bf16, through
              bench_vs_deepspeed.py: ZeRO-0, ZeRO-3, ZeRO-3 + CPU offload of optimizer and
              parameters; step time, tokens/s, peak GPU memory, model FLOPs utilisation
  e  ladder   ZeRO-Offload capacity: the largest GPT-lite of 1.3B, 2.7B, 6.7B, 13B that takes 3
              steps on one GPU with optimizer and parameters offloaded to the CPU; peak GPU and
              host memory and the step time of each rung, ours and DeepSpeed's in turn
  f  deepspeed  whether DeepSpeed 0.19.8 could be carried and ran (its rows sit in c, d and e)

Without a GPU (no working nvidia-smi, or torch sees no CUDA device) every step says "skipped:
no GPU" and the report is still written. Writes OUT/gpu_report.md, OUT/gpu_report.json and
OUT/gpu_check.log (every step's output).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GiB = 2 ** 30

# Dense bf16 matrix rate of the card from its datasheet (TFLOP/s), for model FLOPs utilisation.
# H100 and H200 SXM share the H100's arithmetic; the measured matrix rate is reported beside it.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.05, "L4": 121.0, "GH200": 989.4}

# GPT-lite shapes: (name, n_embd, n_layer, n_head). "medium" is GPT-2-medium-sized (about 350M
# parameters with the byte vocabulary); the ladder follows the ZeRO-Offload paper's model sizes.
MEDIUM = ("350M", 1024, 28, 16)
LADDER = [("1.3B", 2048, 24, 16), ("2.7B", 2560, 32, 20), ("6.7B", 4096, 32, 32), ("13B", 5120, 40, 40)]
VOCAB = 256


def gptlite_params(n_embd: int, n_layer: int, block: int, vocab: int = VOCAB) -> int:
    """Parameters of scripts/bench_gptlite.GPTlite: per block 4 d^2 (q, k, v, proj) + 8 d^2
    (the MLP) + biases and norms; embeddings, the final norm and the LM head."""
    d = n_embd
    per_block = 12 * d * d + d + 4 * d + d  # weights; proj, fc1 and fc2 biases
    per_block += 4 * d  # two LayerNorms
    return n_layer * per_block + vocab * d + block * d + 2 * d + d * vocab + vocab


def flops_per_token(params: int, n_embd: int, n_layer: int, block: int, vocab: int = VOCAB) -> float:
    """Model FLOPs of training one token (forward + backward, no recomputation): 6 per
    non-embedding parameter plus attention's 12 * layers * width * sequence (PaLM's count)."""
    embedding = vocab * n_embd + block * n_embd
    return 6 * (params - embedding) + 12 * n_layer * n_embd * block


# -- steps -----------------------------------------------------------------------------------
@dataclass
class StepResult:
    step: str
    title: str
    status: str = "not run"  # ok | failed: ... | timed out after N s | skipped: ...
    seconds: float = 0.0
    figures: Dict[str, object] = field(default_factory=dict)
    log_tail: str = ""


@dataclass
class Context:
    out: Path
    work: Path
    log: Path
    python: str
    deadline: float
    dry_run: bool
    gpu: bool
    why_no_gpu: str = ""
    deepspeed: Optional[str] = None  # DeepSpeed's version when a real one is importable
    why_no_deepspeed: str = ""
    ds_build: Optional[subprocess.Popen] = None
    env: Dict[str, str] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def run_logged(ctx: Context, title: str, cmd: List[str], limit: float, env: Optional[dict] = None,
               cwd: Optional[Path] = None) -> tuple:
    """Run `cmd` in its own process group, its output appended to the check's log, killed
    (the whole group) at `limit` seconds. Returns (returncode or None when timed out,
    seconds, the output's last lines)."""
    limit = max(1.0, min(limit, ctx.remaining()))
    with open(ctx.log, "a") as log:
        log.write(f"\n===== {title}: {' '.join(shlex.quote(c) for c in cmd)} (limit {limit:.0f} s)\n")
        log.flush()
        start = time.monotonic()
        cap = ctx.work / "last-output.txt"
        with open(cap, "w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=str(cwd or ROOT),
                                    env=dict(os.environ, **ctx.env, **(env or {})), start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
                _kill_group(proc)
        seconds = time.monotonic() - start
        text = cap.read_text(errors="replace")
        log.write(text)
        log.write(f"===== {title}: {'timed out' if rc is None else 'exit ' + str(rc)} after {seconds:.1f} s\n")
    tail = "\n".join(text.rstrip().splitlines()[-15:])
    return rc, seconds, tail


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def python_json(ctx: Context, title: str, code: str, limit: float) -> tuple:
    """Run a Python snippet that prints one JSON object as its last line."""
    rc, seconds, tail = run_logged(ctx, title, [ctx.python, "-c", code], limit)
    data = None
    if rc == 0:
        try:
            data = json.loads(tail.splitlines()[-1])
        except (ValueError, IndexError):
            data = None
    return rc, seconds, tail, data


def status_of(rc, seconds: float, limit: float) -> str:
    if rc is None:
        return f"timed out after {seconds:.0f} s (limit {limit:.0f} s)"
    return "ok" if rc == 0 else f"failed: exit {rc}"


CEILINGS = r"""
import json, time, torch
d = torch.device("cuda")
a = torch.randn(8192, 8192, device=d, dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device=d, dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(10):
    a @ b
e1.record(); torch.cuda.synchronize()
mm = 10 * 2 * 8192 ** 3 / (e0.elapsed_time(e1) / 1e3) / 1e12
x = torch.randn(2 ** 30 // 4 * 2, device=d)  # 2 GiB
y = torch.empty_like(x)
for _ in range(2):
    y.copy_(x)
torch.cuda.synchronize(); e0.record()
for _ in range(10):
    y.copy_(x)
e1.record(); torch.cuda.synchronize()
bw = 10 * 2 * x.nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9
p = torch.cuda.get_device_properties(0)
print(json.dumps({"device": torch.cuda.get_device_name(), "capability": "%d.%d" % torch.cuda.get_device_capability(),
                  "multiprocessors": p.multi_processor_count, "gpu_memory_gib": p.total_memory / 2 ** 30,
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "bf16_matmul_tflops": mm, "copy_gbps": bw}))
"""

DS_BUILD = r"""
import json, time
t0 = time.perf_counter()
from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder
out = {}
for name, b in (("FusedAdam", FusedAdamBuilder()), ("CPUAdam", CPUAdamBuilder())):
    t = time.perf_counter()
    try:
        b.load(verbose=False)
        out[name] = round(time.perf_counter() - t, 1)
    except Exception as e:
        out[name] = "failed: %s" % (str(e).splitlines() or [type(e).__name__])[-1][:200]
print(json.dumps(out))
"""


def step_env(ctx: Context, res: StepResult) -> None:
    figures = res.figures
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        figures["nvidia_smi"] = f"not available: {e}"
    versions = subprocess.run([ctx.python, "-c", "import torch, json; print(json.dumps({'torch': torch.__version__, "
                               "'cuda': torch.version.cuda, 'cuda_available': torch.cuda.is_available()}))"],
                              capture_output=True, text=True, timeout=120)
    try:
        figures.update(json.loads(versions.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        figures["torch"] = f"not importable: {(versions.stderr.strip().splitlines() or ['?'])[-1]}"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc:
        v = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        figures["nvcc"] = (v.stdout.strip().splitlines() or ["?"])[-1]
    else:
        figures["nvcc"] = "not found"
    figures["deepspeed"] = ctx.deepspeed or f"not carried: {ctx.why_no_deepspeed}"
    if not ctx.gpu:
        res.status = f"skipped: no GPU ({ctx.why_no_gpu})"
        return
    rc, _, tail, data = python_json(ctx, "a: the card's ceilings", CEILINGS, 60)
    if data:
        figures.update(data)
    else:
        figures["ceilings"] = f"failed: {tail.splitlines()[-1] if tail else rc}"
    # DeepSpeed's ops build beside ours (it only compiles: no GPU work), so its later steps load them
    if ctx.deepspeed:
        ds_log = open(ctx.work / "ds-build.log", "w")
        ctx.ds_build = subprocess.Popen([ctx.python, "-c", DS_BUILD], stdout=ds_log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, **ctx.env), start_new_session=True)
        ctx.ds_build_started = time.monotonic()
    cache = ctx.work / "ops-cache"
    limit = 150
    rc, seconds, tail = run_logged(ctx, "a: dslaunch build-ops --cuda (cold)",
                                   [ctx.python, "-m", "dslaunch.launcher.main", "build-ops", "--cuda",
                                    "--cache-dir", str(cache)], limit)
    figures["build_ops_seconds"] = round(seconds, 1)
    figures["build_ops"] = tail
    res.status = status_of(rc, seconds, limit)
    if rc == 0:
        ctx.env["DSLAUNCH_OPS_CACHE"] = str(cache)  # every later step loads these builds
    res.log_tail = tail


def wait_ds_build(ctx: Context, res: Optional[StepResult] = None) -> None:
    """DeepSpeed's cold op build (started in step a) must end before a step runs DeepSpeed."""
    if ctx.ds_build is None:
        return
    try:
        ctx.ds_build.wait(timeout=max(1.0, min(240.0, ctx.remaining() - 60)))
    except subprocess.TimeoutExpired:
        _kill_group(ctx.ds_build)
        ctx.why_no_deepspeed = "its op build did not finish in time"
        ctx.deepspeed_ran = False
    text = (ctx.work / "ds-build.log").read_text(errors="replace")
    ctx.ds_build_seconds = time.monotonic() - ctx.ds_build_started
    try:
        ctx.ds_build_result = json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        ctx.ds_build_result = {"error": (text.strip().splitlines() or ["no output"])[-1][:300]}
    with open(ctx.log, "a") as log:
        log.write(f"\n===== DeepSpeed's op build (cold, beside step a)\n{text}\n")
    ctx.ds_build = None


def gpu_test_files() -> List[str]:
    """Test files with gpu-marked tests whose imports exist here (paramiko, which the SSH
    tests need, is not on every GPU image)."""
    files = []
    try:
        import importlib.util
        have_paramiko = importlib.util.find_spec("paramiko") is not None
    except Exception:
        have_paramiko = False
    for path in sorted((ROOT / "tests").rglob("test_*.py")):  # tests/<area>/...
        text = path.read_text()
        if "mark.gpu" not in text:
            continue
        if not have_paramiko and ("paramiko" in text or "testbed" in text):
            continue
        files.append(str(path.relative_to(ROOT)))
    return files


def step_tests(ctx: Context, res: StepResult) -> None:
    files = gpu_test_files()
    junit = ctx.work / "gpu-tests.xml"
    limit = 110
    rc, seconds, tail = run_logged(ctx, "b: gpu-marked tests",
                                   [ctx.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                    "-o", "addopts=", "--timeout", "100", f"--junitxml={junit}", *files], limit)
    res.log_tail = tail
    res.figures["files"] = files
    counts = junit_counts(junit)
    res.figures.update(counts)
    if rc is None:
        res.status = f"timed out after {seconds:.0f} s (limit {limit} s)"
    elif rc == 0:
        res.status = "ok"
    else:
        res.status = f"failed: {counts.get('failed', '?')} failed, {counts.get('errors', '?')} errors"


def junit_counts(path: Path) -> Dict[str, object]:
    try:
        import xml.etree.ElementTree as ET
        root = ET.parse(path).getroot()
    except (OSError, Exception):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    for s in suites:
        out["tests"] += int(s.get("tests", 0))
        out["failed"] += int(s.get("failures", 0))
        out["errors"] += int(s.get("errors", 0))
        out["skipped"] += int(s.get("skipped", 0))
        for case in s.iter("testcase"):
            for kind in ("failure", "error"):
                el = case.find(kind)
                if el is not None:
                    msg = (el.get("message") or "").splitlines()
                    out["failures"].append(f"{case.get('classname')}::{case.get('name')}: {msg[0][:300] if msg else kind}")
    out["passed"] = out["tests"] - out["failed"] - out["errors"] - out["skipped"]
    return out


def step_adam(ctx: Context, res: StepResult) -> None:
    wait_ds_build(ctx)
    out = ctx.work / "adam.json"
    limit = 60
    cmd = [ctx.python, str(HERE / "bench_adam.py"), "--cuda-only", "--sizes", "100M", "--tensors", "1,200",
           "--dtypes", "bf16,fp32", "--rounds", "20", "--json", str(out)]
    if ctx.deepspeed and getattr(ctx, "deepspeed_ran", True):
        cmd.append("--deepspeed")
    rc, seconds, tail = run_logged(ctx, "c: FusedAdam against torch's fused AdamW", cmd, limit)
    res.status = status_of(rc, seconds, limit)
    res.log_tail = tail
    if out.exists():
        res.figures.update(json.loads(out.read_text()))


def step_gptlite(ctx: Context, res: StepResult) -> None:
    wait_ds_build(ctx)
    name, d, layers, heads = MEDIUM
    block, micro = 512, 8
    out = ctx.work / "gptlite.json"
    limit = 150
    cmd = [ctx.python, str(HERE / "bench_vs_deepspeed.py"), "--cuda", "--nprocs", "1", "--lean",
           "--only", "0-bf16,3-bf16,3-bf16-cpu", "--n-embd", str(d), "--n-layer", str(layers), "--n-head", str(heads),
           "--block", str(block), "--micro", str(micro), "--steps", "8", "--warmup", "3",
           "--threads", str(min(16, os.cpu_count() or 1)), "--json", str(out), "--workdir", str(ctx.work / "gptlite"),
           "--extensions-dir", str(ctx.work / "torch_extensions"), "--first-step-timeout", "120", "--step-timeout", "60"]
    if ctx.deepspeed and getattr(ctx, "deepspeed_ran", True):
        cmd += ["--deepspeed-python", ctx.python]
    else:
        cmd += ["--deepspeed-python", "/nonexistent-deepspeed-python"]
    rc, seconds, tail = run_logged(ctx, f"d: GPT-lite {name} on one GPU, bf16", cmd, limit)
    res.status = status_of(rc, seconds, limit)
    res.log_tail = tail
    P = gptlite_params(d, layers, block)
    fpt = flops_per_token(P, d, layers, block)
    peak = card_peak(ctx)
    res.figures.update({"model": f"GPT-lite d{d} L{layers} h{heads}, block {block}, micro batch {micro}",
                        "params": P, "tokens_per_step": block * micro, "flops_per_token": fpt,
                        "bf16_peak_tflops": peak})
    if out.exists():
        data = json.loads(out.read_text())
        rows = []
        for r in data.get("rows", []):
            row = {"row": r.get("config"), "ours_failed": r.get("ours_failed"), "ds_failed": r.get("ds_failed"),
                   "dloss_ds": r.get("dloss_ds"), "ours_first_s": r.get("ours_first_s"), "ds_first_s": r.get("ds_first_s")}
            for side, key in (("ours", "ours_s"), ("deepspeed", "ds_s"), ("floor", "floor_s")):
                t = r.get(key)
                if t:
                    tps = block * micro / t
                    row[side] = {"step_s": t, "tokens_per_s": tps,
                                 "mfu": tps * fpt / (peak * 1e12) if peak else None}
            row["ours_peak_gib"] = (r.get("ours_peak") or 0) / GiB or None
            row["ds_peak_gib"] = (r.get("ds_peak") or 0) / GiB or None
            rows.append(row)
        res.figures["rows"] = rows


def card_peak(ctx: Context) -> Optional[float]:
    name = str(getattr(ctx, "device_name", ""))
    for key, value in sorted(BF16_PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


def host_memory() -> Dict[str, int]:
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return info


def offload_host_bytes(params: int) -> int:
    """Host bytes of ZeRO-3 with optimizer and parameters on the CPU, bf16: the model built
    in fp32 before the engine takes it (4), fp32 masters and Adam's moments (12), fp32
    gradient partitions (4), the bf16 parameter shards (2); plus 4 GiB of runtime."""
    return 22 * params + 4 * GiB


def step_ladder(ctx: Context, res: StepResult) -> None:
    wait_ds_build(ctx)
    block, micro, steps = 512, 4, 3
    rungs = []
    res.figures["rungs"] = rungs
    res.figures["how"] = (f"ZeRO-3, bf16, offload_optimizer and offload_param to the CPU, micro batch {micro} x "
                          f"{block} tokens, {steps} steps; a rung is skipped when its predicted host bytes "
                          "(22 per parameter + 4 GiB) exceed 90% of MemAvailable")
    sides = ["dslaunch"] + (["deepspeed"] if ctx.deepspeed and getattr(ctx, "deepspeed_ran", True) else [])
    corpus = ctx.work / "corpus.bin"
    if not corpus.exists():
        import sysconfig
        with open(corpus, "wb") as fh:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            for p in sorted(stdlib.glob("*.py"))[:200]:
                fh.write(p.read_bytes())
    failed = {s: False for s in sides}
    statuses = []
    for name, d, layers, heads in LADDER:
        P = gptlite_params(d, layers, block)
        need = offload_host_bytes(P)
        avail = host_memory().get("MemAvailable", 0)
        for side in sides:
            rung = {"rung": name, "side": side, "params": P, "predicted_host_gib": need / GiB}
            rungs.append(rung)
            if failed[side]:
                rung["status"] = "skipped: a smaller rung did not finish"
                continue
            if avail and need > 0.9 * avail:
                rung["status"] = f"skipped: needs about {need / GiB:.0f} GiB of host memory, {avail / GiB:.0f} GiB available"
                failed[side] = True
                continue
            if ctx.remaining() < 30:
                rung["status"] = "skipped: out of the check's time"
                failed[side] = True
                continue
            cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                   "steps_per_print": 10 ** 9, "gradient_clipping": 1.0, "bf16": {"enabled": True},
                   "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                   "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "offload_param": {"device": "cpu", "pin_memory": True}}}
            cfg_path = ctx.work / f"ladder-{name}.json"
            cfg_path.write_text(json.dumps(cfg))
            summary = ctx.work / f"ladder-{name}-{side}.json"
            port = free_port()
            env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(min(16, os.cpu_count() or 1)),
                   "DS_ACCELERATOR": "cuda", "TORCH_EXTENSIONS_DIR": str(ctx.work / "torch_extensions")}
            limit = min(150.0, ctx.remaining() - 5)
            rc, seconds, tail = run_logged(ctx, f"e: ladder {name} ({side})",
                                           [ctx.python, str(HERE / "bench_gptlite.py"), "--impl", side,
                                            "--deepspeed_config", str(cfg_path), "--corpus", str(corpus), "--cuda",
                                            "--steps", str(steps), "--block", str(block), "--n-embd", str(d),
                                            "--n-head", str(heads), "--n-layer", str(layers),
                                            "--measure-step", str(10 ** 6), "--summary-json", str(summary)], limit,
                                           env=env)
            rung["status"] = status_of(rc, seconds, limit)
            rung["seconds"] = round(seconds, 1)
            if rc != 0:
                rung["error"] = tail.splitlines()[-1] if tail else ""
                failed[side] = True
            if summary.exists():
                s = json.loads(summary.read_text())
                rung.update({"step_s": s["step_seconds"], "losses": s["losses"],
                             "peak_gpu_gib": s.get("cuda_max_allocated", 0) / GiB, "peak_host_gib": s["peak_rss"] / GiB})
            statuses.append(rung["status"])
    ok = [r for r in rungs if r.get("status") == "ok"]
    res.figures["largest"] = {side: max((r["rung"] for r in ok if r["side"] == side), default=None,
                                        key=lambda n: [x[0] for x in LADDER].index(n)) for side in sides}
    res.status = "ok" if ok else ("failed: no rung ran" if statuses else "skipped")


def free_port() -> int:
    # scripts/bench_timing.py's, which every script shares (imported here: the tests load this
    # file by path, without scripts/ on sys.path)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_timing import free_port as shared

    return shared()


def step_deepspeed(ctx: Context, res: StepResult) -> None:
    if ctx.deepspeed:
        wait_ds_build(ctx)
        res.figures["version"] = ctx.deepspeed
        res.figures["op_build_cold"] = getattr(ctx, "ds_build_result", None)
        ran = getattr(ctx, "deepspeed_ran", True)
        res.status = "ok: its rows are in steps c, d and e" if ran else f"failed: {ctx.why_no_deepspeed}"
    else:
        res.status = f"skipped: DeepSpeed not carried ({ctx.why_no_deepspeed})"


STEPS: List[tuple] = [
    ("a", "Versions, the card's ceilings, and the ops built cold", step_env),
    ("b", "The gpu-marked tests", step_tests),
    ("c", "FusedAdam against torch's fused AdamW (and DeepSpeed's FusedAdam)", step_adam),
    ("d", "GPT-lite 350M on one GPU, bf16: ZeRO-0, ZeRO-3, ZeRO-3 + CPU offload", step_gptlite),
    ("e", "ZeRO-Offload capacity ladder: 1.3B, 2.7B, 6.7B, 13B", step_ladder),
    ("f", "DeepSpeed 0.19.8 beside ours", step_deepspeed),
]


# -- the machine ------------------------------------------------------------------------------
def detect_gpu(python: str) -> tuple:
    """(True, "") when nvidia-smi answers and torch sees a CUDA device, else (False, why)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False, "no nvidia-smi on PATH"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"nvidia-smi failed: {e}"
    if r.returncode != 0 or "GPU" not in r.stdout:
        return False, f"nvidia-smi lists no GPU ({(r.stderr or r.stdout).strip()[:200]})"
    probe = subprocess.run([python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return False, "torch sees no CUDA device" if probe.returncode == 3 else \
            f"torch does not import: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return True, ""


def detect_deepspeed(python: str) -> tuple:
    """(version, "") when a real DeepSpeed (not dslaunch's compatibility package) imports."""
    r = subprocess.run([python, "-c", "import deepspeed, sys; sys.exit(3) if hasattr(deepspeed, '_aliases') else "
                        "print(deepspeed.__version__)"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DS_ACCELERATOR="cuda"))
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1], ""
    if r.returncode == 3:
        return None, "the importable `deepspeed` is dslaunch's compatibility package"
    return None, (r.stderr.strip().splitlines() or ["not importable"])[-1][:200]


# -- the report --------------------------------------------------------------------------------
def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def write_report(ctx: Context, results: List[StepResult], started: float) -> None:
    payload = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seconds": round(time.monotonic() - started, 1),
               "dry_run": ctx.dry_run, "gpu": ctx.gpu, "why_no_gpu": ctx.why_no_gpu,
               "steps": [asdict(r) for r in results]}
    (ctx.out / "gpu_report.json").write_text(json.dumps(payload, indent=1, default=str))
    by = {r.step: r for r in results}
    lines = ["# GPU check", "",
             f"Written by `scripts/gpu_check.sh` on {payload['generated']}, in {payload['seconds']:.0f} s."
             + (" Dry run: nothing was executed." if ctx.dry_run else ""), ""]
    a = by.get("a")
    if a is not None:
        f = a.figures
        lines += [f"Device: {f.get('device') or f.get('nvidia_smi', '-')}; torch {f.get('torch', '-')}, CUDA "
                  f"{f.get('cuda', '-')}; nvcc: {f.get('nvcc', '-')}; DeepSpeed: {f.get('deepspeed', '-')}.", ""]
        if f.get("bf16_matmul_tflops"):
            lines += [f"Measured ceilings: bf16 8192^3 matrix product {f['bf16_matmul_tflops']:.0f} TFLOP/s; "
                      f"device copy {f['copy_gbps']:.0f} GB/s (bytes read + written).", ""]
    lines += ["| step | what | status | seconds |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.step} | {r.title} | {r.status} | {r.seconds:.0f} |")
    lines.append("")
    if a is not None and a.figures.get("build_ops_seconds") is not None:
        lines += ["## a. Ops build", "", f"`dslaunch build-ops --cuda`, cold: {a.figures['build_ops_seconds']} s.", "",
                  "```text", str(a.figures.get("build_ops", "")), "```", ""]
    b = by.get("b")
    if b is not None and "tests" in b.figures:
        f = b.figures
        lines += ["## b. gpu-marked tests", "",
                  f"{f.get('passed')} passed, {f.get('failed')} failed, {f.get('errors')} errors, "
                  f"{f.get('skipped')} skipped, of {f.get('tests')}.", ""]
        lines += [f"- {x}" for x in f.get("failures", [])]
        lines.append("")
    c = by.get("c")
    if c is not None and c.figures.get("rows"):
        lines += ["## c. FusedAdam", "", "| params | tensors | dtype | ours ms | torch fused ms | DeepSpeed ms | "
                  "ours vs torch | ours vs DeepSpeed | ours of HBM bound |", "|---|---|---|---|---|---|---|---|---|"]
        for r in c.figures["rows"]:
            ms = r["ms"]
            lines.append(f"| {r['params']:,} | {r['tensors']} | {r['dtype']} | {ms['dslaunch FusedAdam']:.3f} | "
                         f"{ms['torch AdamW(fused=True)']:.3f} | {fmt(ms.get('DeepSpeed FusedAdam'), '.3f')} | "
                         f"{r['ours_vs_torch_fused']:.2f}x | {fmt(r.get('ours_vs_deepspeed'), '.2f')} | "
                         f"{100 * r['of_bound']['dslaunch FusedAdam']:.0f}% |")
        lines.append("")
    d = by.get("d")
    if d is not None and d.figures.get("rows"):
        f = d.figures
        lines += ["## d. GPT-lite on one GPU", "",
                  f"{f['model']}: {f['params'] / 1e6:.0f}M parameters, {f['tokens_per_step']} tokens a step; "
                  f"MFU = tokens/s x {f['flops_per_token'] / 1e9:.2f} GFLOP a token / "
                  f"{fmt(f.get('bf16_peak_tflops'))} TFLOP/s (datasheet dense bf16).", "",
                  "| config | ours s/step | ours tokens/s | ours MFU | ours peak GiB | DeepSpeed s/step | "
                  "DeepSpeed tokens/s | DeepSpeed MFU | DeepSpeed peak GiB | floor s/step |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in f["rows"]:
            o, s, fl = r.get("ours", {}), r.get("deepspeed", {}), r.get("floor", {})
            lines.append(f"| {r['row']} | {fmt(o.get('step_s'))} | {fmt(o.get('tokens_per_s'), '.0f')} | "
                         f"{fmt(o.get('mfu'), '.1%')} | {fmt(r.get('ours_peak_gib'), '.1f')} | {fmt(s.get('step_s'))} | "
                         f"{fmt(s.get('tokens_per_s'), '.0f')} | {fmt(s.get('mfu'), '.1%')} | "
                         f"{fmt(r.get('ds_peak_gib'), '.1f')} | {fmt(fl.get('step_s'))} |")
        lines.append("")
    e = by.get("e")
    if e is not None and e.figures.get("rungs"):
        lines += ["## e. ZeRO-Offload capacity", "", e.figures["how"] + ".", "",
                  "| rung | side | params | status | step s | peak GPU GiB | peak host GiB | predicted host GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in e.figures["rungs"]:
            steps = r.get("step_s") or []
            step = ", ".join(f"{t:.2f}" for t in steps) if steps else "-"
            lines.append(f"| {r['rung']} | {r['side']} | {r['params'] / 1e9:.2f}B | {r['status']} | {step} | "
                         f"{fmt(r.get('peak_gpu_gib'), '.1f')} | {fmt(r.get('peak_host_gib'), '.1f')} | "
                         f"{r['predicted_host_gib']:.0f} |")
        lines += ["", f"Largest rung that ran: {e.figures.get('largest')}.", ""]
    f_ = by.get("f")
    if f_ is not None:
        lines += ["## f. DeepSpeed", "", f"{f_.status}. Cold op build: {f_.figures.get('op_build_cold', '-')}.", ""]
    for r in results:
        if r.status not in ("ok",) and r.log_tail and not r.status.startswith("skipped"):
            lines += [f"## Output of step {r.step} ({r.status})", "", "```text", r.log_tail, "```", ""]
    (ctx.out / "gpu_report.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for gpu_report.md, gpu_report.json and gpu_check.log")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and write a report; run nothing")
    ap.add_argument("--only", default="", help="comma-separated steps to run (a,b,c,d,e,f); default all")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole check (each step also has its own limit)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    known = [s[0] for s in STEPS]
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in known]
    if bad:
        print(f"gpu_check: --only: unknown step {bad[0]!r}; steps are {', '.join(known)}", file=sys.stderr)
        return 2
    python = sys.executable
    gpu, why = (False, "dry run") if args.dry_run else detect_gpu(python)
    ctx = Context(out=out, work=work, log=out / "gpu_check.log", python=python, deadline=started + args.budget,
                  dry_run=args.dry_run, gpu=gpu, why_no_gpu=why)
    # one folder for DeepSpeed's JIT-built ops, so the build of step a serves every later step
    ctx.env["TORCH_EXTENSIONS_DIR"] = str(work / "torch_extensions")
    ctx.log.write_text(f"gpu_check: started {time.strftime('%Y-%m-%d %H:%M:%S')}; work folder {work}\n")
    if gpu:
        ctx.deepspeed, ctx.why_no_deepspeed = detect_deepspeed(python)
        ctx.device_name = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name())"],
                                         capture_output=True, text=True).stdout.strip()
    elif not args.dry_run:
        ctx.why_no_deepspeed = "no GPU"
    results = []
    for key, title, fn in STEPS:
        res = StepResult(key, title)
        results.append(res)
        if only and key not in only:
            res.status = "skipped: not asked for (--only)"
            continue
        if args.dry_run:
            res.status = "dry run"
            print(f"gpu_check: step {key}: {title}")
            continue
        if not gpu and key != "a":
            res.status = f"skipped: no GPU ({why})"
            print(f"gpu_check: step {key}: {res.status}", flush=True)
            continue
        if ctx.remaining() < 10:
            res.status = "skipped: out of the check's time budget"
            continue
        t0 = time.monotonic()
        print(f"gpu_check: step {key}: {title} ...", flush=True)
        try:
            fn(ctx, res)
        except Exception as exc:  # one step's own bug must not cost the other steps' figures
            res.status = f"failed: {type(exc).__name__}: {exc}"
        res.seconds = time.monotonic() - t0
        print(f"gpu_check: step {key}: {res.status} ({res.seconds:.0f} s)", flush=True)
        write_report(ctx, results, started)  # after every step: a kill later still leaves these figures
    if ctx.ds_build is not None:
        _kill_group(ctx.ds_build)
    write_report(ctx, results, started)
    print(f"gpu_check: report in {out / 'gpu_report.md'}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
