"""dslaunch against real DeepSpeed on one GPT-lite script, config by config.

    python scripts/bench_vs_deepspeed.py [--nprocs 2] [--steps 20] [--threads 1]
        [--deepspeed-python /path/to/env/bin/python] [--only 2-bf16,3-fp32-cpu] [--bucket N] [--cuda]

It installs nothing. DeepSpeed runs from the environment of --deepspeed-python (default:
$DEEPSPEED_PYTHON, else this interpreter) when `import deepspeed` works there; ours runs
from this interpreter. Both run scripts/bench_gptlite.py, the same DeepSpeed-style script
(only its import differs), with the same JSON config, data, seed and OMP_NUM_THREADS
(DeepSpeed's launcher leaves it unset and ours sets it, so it is set explicitly here).

Per config (ZeRO stage 0-3 x fp32/bf16 x offload none/cpu, plus NVMe rows, Muon rows:
`"optimizer": {"type": "Muon"}` at stages 0-3, names ending in -muon, and the low-precision
master rows: bf16 masters and moments at stages 1-3 (`-m16`), under CPU offload with bf16 or fp32
moments (`-cpu-m16`, `-cpu-m16s32`), and fp16 parameters with fp16 masters and fp32 or fp16 moments
under CPU offload (`N-fp16-cpu-m16s32`, `N-fp16-cpu-m16`), each side against its own formula) every
contender is started in turn (time to first step is taken with the others idle: DeepSpeed
compiles its CPU ops on first use), then all are stepped round-robin, one step each, the
order rotating every step, while the others wait on a pipe: load from the rest of the
machine falls on all of them alike. Contenders: ours; DeepSpeed; our stage 0 (stage 1-3
rows: the "vs st0" ratio); torch DDP + AdamW (stage-0 rows: the numerics reference and the
"vs DDP" ratio); torch FSDP2 (stage-3 rows when DeepSpeed is missing); the compute floor
(every row: forward + backward alone on every rank in the row's dtype, no engine, no
communication, no optimizer).

Printed per config:
  step time: median seconds per step after warm-up, ours / DeepSpeed, ours / our stage 0,
             stage 0 / DDP (or stage 3 / FSDP2), the floor, and (ours - floor) / (DeepSpeed -
             floor): each engine's own cost above the compute every engine repeats with the
             same torch kernels (communication, clipping, the optimizer, stage 3's gathers);
  memory:    bytes per rank between steps (after the optimizer step, against ZeRO's formula
             without gradients; Muon rows: 4 bytes of momentum per Muon element and Adam's 8 per
             element of the rest, and the ratio to the same config's Adam row) and at forward's peak (end of forward, the saved activations
             included; with --cuda max_memory_allocated over the forward), ours and DeepSpeed;
             bytes per rank held after backward (live tensor storages, see bench_gptlite.py;
             with --cuda torch.cuda.memory_allocated), ours / DeepSpeed, and each over the
             ZeRO formula for that side's gradient-accumulation dtype, plus one
             communication bucket (min(reduce_bucket_size, P) elements) as the allowance;
             with --cuda also peak torch.cuda.max_memory_allocated;
  numerics:  max |loss difference| per step ours - DeepSpeed, and fp32 ours - torch DDP;
  start-up:  seconds from process start to the end of the first step, ours and DeepSpeed.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional
from bench_timing import free_port, median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bench_gptlite.py")
MB = 1 / 2 ** 20


# -- configs ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    stage: int
    dtype: str  # fp32 | bf16 | fp16 (fp16: the master rows only)
    offload: str = "none"  # none | cpu | nvme
    optimizer: str = "adam"  # adam | muon
    # ZeRO's master weights: fp32; "bf16" (bf16.bf16_master_weights_and_grads with
    # bf16_optimizer_states: masters, gradient partitions and Adam's moments in bf16); "bf16s32"
    # (bf16 masters and gradients, fp32 moments: DeepSpeed allows it under CPU offload only);
    # "fp16s32" (fp16.fp16_master_weights_and_grads: fp16 masters and gradients, fp32 moments;
    # CPU offload only); "fp16" (fp16 masters and gradients with fp16 moments:
    # optimizer.params.fp32_optimizer_states false, CPU offload only)
    masters: str = "fp32"

    @property
    def name(self) -> str:
        suffix = {"fp32": "", "bf16": "-m16", "bf16s32": "-m16s32", "fp16s32": "-m16s32", "fp16": "-m16"}[self.masters]
        return f"{self.stage}-{self.dtype}" + ("" if self.offload == "none" else f"-{self.offload}") + \
            ("" if self.optimizer == "adam" else f"-{self.optimizer}") + suffix


def all_rows() -> List[Row]:
    rows = []
    for dtype in ("fp32", "bf16"):
        rows.append(Row(0, dtype))
        rows += [Row(s, dtype) for s in (1, 2, 3)]
        rows += [Row(s, dtype, "cpu") for s in (1, 2, 3)]
        rows += [Row(s, dtype, "nvme") for s in (2, 3)]
    rows += [Row(s, "fp32", optimizer="muon") for s in (0, 1, 2, 3)]
    rows += [Row(2, "bf16", optimizer="muon"), Row(2, "fp32", "cpu", "muon")]
    # low-precision master states, each combination DeepSpeed 0.19.8 allows
    rows += [Row(s, "bf16", masters="bf16") for s in (1, 2, 3)]
    rows += [Row(s, "bf16", "cpu", masters=masters) for masters in ("bf16", "bf16s32") for s in (1, 2, 3)]
    rows += [Row(s, "fp16", "cpu", masters=masters) for masters in ("fp16s32", "fp16") for s in (1, 2, 3)]
    return rows


# Muon's settings in the Muon rows: its own learning rate for the hidden matrices, Adam's
# (the Adam rows' betas, eps and decay) for embeddings, norms, biases and the head
MUON_PARAMS = {"muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "betas": [0.8, 0.999], "eps": 1e-8,
               "weight_decay": 3e-7}


def ds_config(row: Row, args, nvme_dir: str) -> dict:
    """The seed post's config (Adam with its betas/eps/decay; gradient clipping as
    train_gpt_config.json) with the row's stage, precision and offload."""
    zero: Dict[str, object] = {"stage": row.stage, "overlap_comm": True, "contiguous_gradients": True}
    if args.bucket:
        zero.update(reduce_bucket_size=args.bucket, allgather_bucket_size=args.bucket,
                    stage3_prefetch_bucket_size=args.bucket)
    if args.persistence is not None and row.stage == 3:
        zero["stage3_param_persistence_threshold"] = args.persistence
    if row.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if row.stage == 3:  # the seed's ZeRO-Infinity config offloads both
            zero["offload_param"] = {"device": "cpu"}
    elif row.offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        if row.stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
           "steps_per_print": 10 ** 9, "gradient_clipping": 1.0,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8,
                                                    "weight_decay": 3e-7}},
           "zero_optimization": zero}
    if row.optimizer == "muon":
        cfg["optimizer"] = {"type": "Muon", "params": dict(MUON_PARAMS)}
        if row.stage == 3:
            zero["reduce_scatter"] = False  # DeepSpeed's stage 3 refuses Muon otherwise
    if row.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if row.dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    if row.masters in ("fp16s32", "fp16"):
        cfg["fp16"]["fp16_master_weights_and_grads"] = True
        if row.masters == "fp16":  # DeepSpeedCPUAdam keeps the moments in the masters' dtype
            cfg["optimizer"]["params"]["fp32_optimizer_states"] = False
    elif row.masters != "fp32":
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=row.masters == "bf16")
    if args.grad_accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    return cfg


# -- the ZeRO formula ----------------------------------------------------------------------------
def accum_bytes(row: Row, side: str, explicit: Optional[str]) -> int:
    """Bytes per element of the gradients each side keeps (data_types.grad_accum_dtype):
    DeepSpeed's default is the model dtype; ours is the model dtype for stages 0-1 (full
    gradients) and fp32 for the partitions of stages 2-3."""
    if row.masters != "fp32":  # both sides: the gradient partitions are the masters' dtype
        return 2
    if explicit:
        return 4 if explicit in ("fp32", "float32") else 2
    model = 4 if row.dtype == "fp32" else 2
    if side == "dslaunch" and row.stage >= 2:
        return 4
    return model


def formula_bytes(row: Row, P: int, N: int, grad_bytes: int, device_only: bool = False, whole: int = 0,
                  muon: int = 0, side: str = "dslaunch") -> float:
    """ZeRO's bytes per rank for Adam: parameters b, gradients g (full for stages 0-1, a 1/N
    partition for 2-3), fp32 masters 4 (none extra in fp32: the parameters are the masters)
    and Adam's two moments 8 (Muon rows: 4, the momentum, for each of the `muon` elements
    Muon steps, 8 for the rest); stage 1 partitions masters and moments, stage 2 also the
    gradients, stage 3 also the parameters. NVMe rows leave out what rests in files (the
    moments; stage 3 also the 16/32-bit parameter shards). With device_only (--cuda),
    offloaded masters, moments and gradient partitions leave out too. Stage 3 keeps `whole`
    of the P parameters unpartitioned (those at most stage3_param_persistence_threshold
    elements, DeepSpeed's default 100000, on both sides).

    Low-precision masters (row.masters): bf16 or fp16 masters 2 on DeepSpeed's side, none extra
    on ours (a rank's master is its slice of the 16-bit parameters, one copy); Adam's moments 4 in
    bf16 or fp16, 8 in fp32. So stage 3 with bf16 parameters, masters and moments between steps: DeepSpeed
    2 + 2 + 4 = 8P/N, ours 2 + 4 = 6P/N, against 2 + 4 + 8 = 14P/N with fp32 masters."""
    b = 4 if row.dtype == "fp32" else 2
    if row.masters == "fp32":
        master, moments = (0 if b == 4 else 4), (8 if row.optimizer == "adam" else (4 * muon + 8 * (P - muon)) / P)
    else:
        master, moments = (2 if side == "deepspeed" else 0), (4 if row.masters in ("bf16", "fp16") else 8)  # 16-bit moments, or fp32
    opt = master + moments
    on_host = row.offload in ("cpu", "nvme")
    if row.offload == "nvme":
        opt -= moments
        if b == 4 and row.stage > 0:
            opt += 4  # the fp32 master stays in memory beside the shard/parameter file
    if device_only and on_host:
        opt = 0
    params = (b * (P - whole) / N + b * whole) / P if row.stage == 3 else b
    if row.stage == 3 and row.offload in ("cpu", "nvme") and device_only:
        params = 0
    if row.stage == 3 and row.offload == "nvme":
        params = 0
    grads = grad_bytes if row.stage < 2 else grad_bytes / N
    if device_only and on_host and row.stage >= 2:
        grads = 0
    optim = opt if row.stage == 0 else opt / N
    return P * (params + grads + optim)


# -- running contenders -----------------------------------------------------------------------
@dataclass
class Contender:
    label: str
    impl: str  # dslaunch | deepspeed | ddp | fsdp2 | floor
    python: str
    cfg_path: str
    procs: List[subprocess.Popen] = field(default_factory=list)
    reads: List[int] = field(default_factory=list)
    log: str = ""
    failed: Optional[str] = None
    steps: List[dict] = field(default_factory=list)  # rank 0's messages merged with the slowest rank's time
    final: List[dict] = field(default_factory=list)


def start(c: Contender, args, corpus: str, workdir: str) -> None:
    port = free_port()
    c.log = os.path.join(workdir, f"{c.label.replace(' ', '_')}.log")
    log = open(c.log, "w")
    for rank in range(args.nprocs):
        r, w = os.pipe()
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nprocs),
                   LOCAL_WORLD_SIZE=str(args.nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(args.threads), BENCH_FD=str(w), BENCH_SPAWNED=repr(time.time()),
                   PYTHONUNBUFFERED="1", DS_ACCELERATOR="cuda" if args.cuda else "cpu")
        if c.impl == "deepspeed":  # its JIT-built ops go to a cache this benchmark owns (see --extensions-dir)
            env["TORCH_EXTENSIONS_DIR"] = args.extensions_dir
        cmd = [c.python, WORKER, "--impl", c.impl, "--deepspeed_config", c.cfg_path, "--corpus", corpus,
               "--measure-step", str(max(1, args.warmup - 1)), "--block", str(args.block), "--n-embd", str(args.n_embd),
               "--n-head", str(args.n_head), "--n-layer", str(args.n_layer)] + (["--cuda"] if args.cuda else [])
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                             pass_fds=(w,), text=True)
        os.close(w)
        c.procs.append(p)
        c.reads.append(r)


def last_lines(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as fh:
            lines = [l.rstrip() for l in fh if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def exchange(c: Contender, command: str, timeout: float) -> Optional[List[dict]]:
    """Send `command` to every rank; one JSON line back from each (None on failure)."""
    if c.failed:
        return None
    for p in c.procs:
        try:
            p.stdin.write(command + "\n")
            p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
    sel = selectors.DefaultSelector()
    bufs = {fd: b"" for fd in c.reads}
    out: Dict[int, dict] = {}
    for i, fd in enumerate(c.reads):
        sel.register(fd, selectors.EVENT_READ, i)
    deadline = time.time() + timeout
    while len(out) < len(c.reads):
        if time.time() > deadline:
            for p in c.procs:  # each rank prints its Python stacks into the log (faulthandler)
                p.send_signal(signal.SIGUSR1)
            time.sleep(2)
            c.failed = f"no answer within {timeout:.0f} s (stacks in {c.log})"
            break
        for key, _ in sel.select(timeout=1.0):
            i = key.data
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                if i not in out:
                    c.failed = f"rank {i} exited ({c.procs[i].wait()}): {last_lines(c.log)}"
                continue
            bufs[key.fd] += chunk
            if b"\n" in bufs[key.fd]:
                line, bufs[key.fd] = bufs[key.fd].split(b"\n", 1)
                out[i] = json.loads(line)
        if c.failed:
            break
    sel.close()
    if c.failed:
        stop(c)
        return None
    return [out[i] for i in range(len(c.reads))]


def stop(c: Contender) -> None:
    for p in c.procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p in c.procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for fd in c.reads:
        try:
            os.close(fd)
        except OSError:
            pass
    c.reads = []


def record_step(c: Contender, msgs: Optional[List[dict]]) -> None:
    if msgs:
        m = dict(msgs[0])
        m["seconds"] = max(x["seconds"] for x in msgs)  # the step ends when the slowest rank's does
        for key in ("bytes_after_forward", "bytes_after_backward", "bytes_between_steps", "cuda_forward_peak",
                    "cuda_between_steps"):
            if key in m:
                m[key] = max(x[key] for x in msgs)  # the rank holding most
        c.steps.append(m)


def run_group(contenders: List[Contender], args, corpus: str, workdir: str, first: int) -> None:
    order = contenders[first:] + contenders[:first]
    for c in order:  # start-up one at a time: the first step includes op builds
        start(c, args, corpus, workdir)
        record_step(c, exchange(c, "step", args.first_step_timeout))
    for s in range(1, args.steps):
        k = s % len(order)
        for c in order[k:] + order[:k]:
            record_step(c, exchange(c, "step", args.step_timeout))
    for c in order:
        if not c.failed:
            c.final = exchange(c, "stop", 120) or []
            stop(c)


def fail(message: str) -> None:
    """A usage error: one line naming the option, exit status 2."""
    print(f"bench_vs_deepspeed: error: {message}", file=sys.stderr)
    sys.exit(2)


def stale_build_locks(root: str) -> List[str]:
    """torch.utils.cpp_extension build locks under `root` whose op has no built library yet."""
    if not os.path.isdir(root):
        return []
    out = []
    for op in sorted(os.listdir(root)):
        folder = os.path.join(root, op)
        if os.path.exists(os.path.join(folder, "lock")) and not any(n.endswith(".so") for n in os.listdir(folder)):
            out.append(os.path.join(folder, "lock"))
    return out


def cuda_devices(n: int) -> bool:
    """Whether this interpreter's torch sees at least `n` CUDA devices (asked in a child, so the
    driver itself never initialises CUDA)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=300)
    return probe.returncode == 0 and int((probe.stdout.split() or ["0"])[-1]) >= n


# -- report ------------------------------------------------------------------------------------
def median_time(c: Contender, warmup: int) -> Optional[float]:
    t = [m["seconds"] for m in c.steps[warmup:]]
    return median(t) if t and not c.failed else None


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def fmt(x, spec=".3f") -> str:
    return format(x, spec) if x is not None else "-"


def mem_of(c: Optional[Contender], cuda: bool, when: str = "after_backward") -> Optional[float]:
    """Bytes held at the measured step: `when` after_backward, between_steps (after the
    optimizer step) or forward (at the end of forward, saved activations included; with
    --cuda the allocator's peak over that forward)."""
    if c is None or c.failed:
        return None
    key = {"after_backward": ("cuda_allocated_after_backward", "bytes_after_backward"),
           "between_steps": ("cuda_between_steps", "bytes_between_steps"),
           "forward": ("cuda_forward_peak", "bytes_after_forward")}[when][0 if cuda else 1]
    vals = [m[key] for m in c.steps if key in m]
    return vals[0] if vals else None


def peak_of(c: Optional[Contender], cuda: bool) -> Optional[float]:
    if c is None or c.failed or not c.final:
        return None
    key = "cuda_max_allocated" if cuda else "peak_rss_growth"
    return max(f.get(key, 0) for f in c.final)


def loss_diff(a: Optional[Contender], b: Optional[Contender]) -> Optional[float]:
    if a is None or b is None or a.failed or b.failed or not a.steps or not b.steps:
        return None
    n = min(len(a.steps), len(b.steps))
    return max(abs(a.steps[i]["loss"] - b.steps[i]["loss"]) for i in range(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median; memory is counted in the last (at least step 1)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every rank of every contender")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=0,
                    help="reduce/allgather/prefetch bucket elements (default: DeepSpeed's defaults)")
    ap.add_argument("--persistence", type=int, default=None,
                    help="stage3_param_persistence_threshold for both sides (default: DeepSpeed's 100000, "
                         "under which a small model's parameters all stay whole)")
    ap.add_argument("--grad-accum-dtype", default=None, help="data_types.grad_accum_dtype for both sides")
    ap.add_argument("--only", default="", help="comma-separated rows, e.g. 0-fp32,2-bf16-cpu")
    ap.add_argument("--deepspeed-python", default=os.environ.get("DEEPSPEED_PYTHON", sys.executable))
    ap.add_argument("--torch-refs", action="store_true", help="FSDP2 in stage-3 rows even with DeepSpeed")
    ap.add_argument("--lean", action="store_true",
                    help="only ours, DeepSpeed and the compute floor (no stage-0 or torch references): for large models")
    ap.add_argument("--cuda", action="store_true", help="NCCL on one GPU per rank; device memory")
    ap.add_argument("--json", default="", help="also write every row's figures to this file")
    ap.add_argument("--workdir", default="",
                    help="folder for the corpus, worker logs and NVMe files (default: a new bench-vs-ds-* folder "
                         "in $TMPDIR, kept and named at the end)")
    ap.add_argument("--extensions-dir", default="",
                    help="TORCH_EXTENSIONS_DIR for DeepSpeed's JIT-built CPU ops (default: a fresh folder per run, "
                         "so its time to first step includes the build, as a new user sees it; a shared cache "
                         "can also hold a stale lock from a killed build, which hangs every later run)")
    ap.add_argument("--first-step-timeout", type=float, default=900)
    ap.add_argument("--step-timeout", type=float, default=300)
    args = ap.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        # memory is counted after a backward that follows an optimizer step (its state exists then)
        fail(f"--warmup {args.warmup} must be at least 1 and below --steps {args.steps}")
    if args.cuda and not cuda_devices(args.nprocs):
        fail(f"--cuda: needs {args.nprocs} CUDA devices visible to {sys.executable}; "
                 "run it on a GPU machine (or leave --cuda out)")

    # dslaunch's opt-in compatibility package is also importable as `deepspeed`: not the peer
    try:
        probe = subprocess.run([args.deepspeed_python, "-c", "import deepspeed, torch, sys; "
                                "sys.exit(3) if hasattr(deepspeed, '_aliases') else None; "
                                "print(deepspeed.__version__, torch.__version__)"], capture_output=True, text=True,
                               timeout=300, env=dict(os.environ, DS_ACCELERATOR="cuda" if args.cuda else "cpu"))
    except OSError as exc:
        fail(f"--deepspeed-python: cannot run {args.deepspeed_python}: {exc.strerror}")
    if probe.returncode == 3:
        probe.stderr = "its `deepspeed` is dslaunch's compatibility package"
    have_ds = probe.returncode == 0
    versions = probe.stdout.strip().splitlines()[-1] if have_ds else ""
    rows = all_rows()
    if args.only:
        want = set(args.only.split(","))
        unknown = want - {r.name for r in rows}
        if unknown:
            fail(f"--only: unknown rows {sorted(unknown)}; known: {', '.join(r.name for r in rows)}")
        rows = [r for r in rows if r.name in want]

    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        workdir = os.path.abspath(args.workdir)
    else:
        workdir = tempfile.mkdtemp(prefix="bench-vs-ds-")
    args.extensions_dir = os.path.abspath(args.extensions_dir or os.path.join(workdir, "torch_extensions"))
    stale = stale_build_locks(args.extensions_dir)
    if stale:  # torch's build lock outlives a killed build and every later load waits on it forever
        fail(f"--extensions-dir: {stale[0]} is a build lock with no built library (an interrupted build, or one still running); "
             "delete it or pick another folder")
    corpus = os.path.join(workdir, "corpus.bin")
    with open(corpus, "wb") as out:  # the stdlib's sources: present everywhere, no download
        stdlib = sysconfig.get_paths()["stdlib"]
        for name in sorted(os.listdir(stdlib))[:200]:
            if name.endswith(".py"):
                with open(os.path.join(stdlib, name), "rb") as fh:
                    out.write(fh.read())
    load = load_start = list(os.getloadavg())
    print(f"bench_vs_deepspeed: {args.nprocs} ranks ({'NCCL, one GPU each' if args.cuda else 'gloo on the CPU'}), "
          f"OMP_NUM_THREADS={args.threads} for every contender, {args.steps} steps (median after {args.warmup}), "
          f"micro batch {args.micro} x {args.block} tokens, GPT-lite n_embd {args.n_embd} x {args.n_layer} layers; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start", flush=True)
    print(f"DeepSpeed: {'deepspeed ' + versions.split()[0] + ' from ' + args.deepspeed_python if have_ds else 'not importable by ' + args.deepspeed_python + ' (' + (probe.stderr.strip().splitlines() or ['?'])[-1] + '); ours against the formula and torch only'}",
          flush=True)

    results = []
    for i, row in enumerate(rows):
        nvme = os.path.join(workdir, f"nvme-{row.name}")
        os.makedirs(nvme, exist_ok=True)

        def cfg_file(r: Row, tag: str) -> str:
            path = os.path.join(workdir, f"{row.name}-{tag}.json")
            with open(path, "w") as fh:
                json.dump(ds_config(r, args, nvme), fh)
            return path

        ours = Contender("dslaunch", "dslaunch", sys.executable, cfg_file(row, "cfg"))
        group = [ours]
        ds = Contender("deepspeed", "deepspeed", args.deepspeed_python, ours.cfg_path) if have_ds else None
        if ds:
            group.append(ds)
        st0_row = Row(0, row.dtype, optimizer=row.optimizer)
        st0 = Contender("dslaunch stage 0", "dslaunch", sys.executable, cfg_file(st0_row, "st0")) \
            if row.stage > 0 and not args.lean else None
        if st0:
            group.append(st0)
        ref = None
        if args.lean or row.optimizer != "adam":  # the torch references step AdamW
            pass
        elif row.stage == 0 and row.dtype == "fp32":
            ref = Contender("torch DDP", "ddp", sys.executable, ours.cfg_path)
        elif row.stage == 3 and row.offload == "none" and (not have_ds or args.torch_refs):
            ref = Contender("torch FSDP2", "fsdp2", sys.executable, ours.cfg_path)
        if ref:
            group.append(ref)
        # every row: the floor is stepped round-robin with the engines, so it sees the same load
        floor = Contender("compute floor", "floor", sys.executable, ours.cfg_path)
        group.append(floor)
        run_group(group, args, corpus, workdir, first=i % len(group))
        results.append((row, ours, ds, st0, ref, floor))
        report_row(row, ours, ds, st0, ref, args, have_ds, floor)
        shutil.rmtree(nvme, ignore_errors=True)
    recs = summary(results, args, have_ds)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"nprocs": args.nprocs, "deepspeed": versions.split()[0] if have_ds else None,
                       "load_start": load_start, "load_end": list(os.getloadavg()), "rows": recs}, fh, indent=1)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end; worker logs in {workdir}")
    return 0


def report_row(row, ours, ds, st0, ref, args, have_ds, floor) -> None:
    """One line per config as it finishes (the run is long; a partial run still says something)."""
    t = median_time(ours, args.warmup)
    parts = [f"{row.name:12} ours {fmt(t)} s"]
    for c in (ds, st0, ref, floor):
        if c is not None:
            parts.append(f"{c.label} {fmt(median_time(c, args.warmup))} s" + (f" [{c.failed}]" if c.failed else ""))
    if ours.failed:
        parts.append(f"[ours failed: {ours.failed}]")
    print("  " + "; ".join(parts), flush=True)


def first_step(c: Optional[Contender]) -> Optional[float]:
    return c.steps[0].get("first_step_done_s") if c is not None and c.steps and not c.failed else None


def above_floor(c: Optional[Contender], floor: Optional[Contender], warmup: int) -> Optional[float]:
    """Median over the timed rounds of (c's step - the floor's step in the same round): the
    engine's own cost, paired round by round so that load drifting between rounds cancels."""
    if c is None or floor is None or c.failed or floor.failed:
        return None
    n = min(len(c.steps), len(floor.steps))
    diffs = [c.steps[i]["seconds"] - floor.steps[i]["seconds"] for i in range(warmup, n)]
    return median(diffs) if diffs else None


def overhead_ratio(ours: Optional[float], ds: Optional[float]) -> Optional[float]:
    """(ours - floor) / (DeepSpeed - floor), from above_floor (None when DeepSpeed's step is not
    above the floor: the load swamped it)."""
    if ours is None or ds is None or ds <= 0:
        return None
    return ours / ds


def record(row: Row, ours, ds, st0, ref, ddp, floor, args) -> dict:
    """One config's figures (None where a contender is missing or failed)."""
    N, cuda = args.nprocs, args.cuda
    P = ours.steps[0]["params"] if ours.steps else None
    threshold = 100_000 if args.persistence is None else args.persistence
    whole = sum(n for n in ours.steps[0]["param_numels"] if n <= threshold) if P and row.stage == 3 else 0
    muon = ours.steps[0].get("muon_numel", 0) if P and row.optimizer == "muon" else 0
    g_ours = accum_bytes(row, "dslaunch", args.grad_accum_dtype)
    g_ds = accum_bytes(row, "deepspeed", args.grad_accum_dtype)
    bucket = min(args.bucket or 500_000_000, P) * (4 if row.dtype == "fp32" else 2) if P else None
    t = median_time(ours, args.warmup)
    t_ds = median_time(ds, args.warmup) if ds else None
    t_floor = median_time(floor, args.warmup) if floor is not None else None
    over_ours, over_ds = above_floor(ours, floor, args.warmup), above_floor(ds, floor, args.warmup)
    return {
        "config": row.name, "params": P, "ours_failed": ours.failed, "ds_failed": ds.failed if ds else None,
        "ours_s": t, "ds_s": t_ds, "ours_above_floor_s": over_ours, "ds_above_floor_s": over_ds,
        "overhead_ratio": overhead_ratio(over_ours, over_ds),
        "steps_s": {c.label: [m["seconds"] for m in c.steps] for c in (ours, ds, st0, ref, floor)
                    if c is not None and not c.failed},
        "st0_s": median_time(st0, args.warmup) if st0 else None,
        "torch_s": median_time(ref, args.warmup) if ref else None, "torch": ref.impl if ref else None,
        "floor_s": t_floor,  # this row's own floor, stepped beside the engines
        "ours_first_s": first_step(ours), "ds_first_s": first_step(ds),
        "ours_bytes": mem_of(ours, cuda), "ds_bytes": mem_of(ds, cuda),
        "ours_between": mem_of(ours, cuda, "between_steps"), "ds_between": mem_of(ds, cuda, "between_steps"),
        "ours_forward": mem_of(ours, cuda, "forward"), "ds_forward": mem_of(ds, cuda, "forward"),
        "floor_forward": mem_of(floor, cuda, "forward"),
        # between steps no gradient is part of ZeRO's bytes (both sides free them at the step)
        "between_formula_bytes": formula_bytes(row, P, N, 0, cuda, whole, muon) if P else None,
        "ds_between_formula_bytes": formula_bytes(row, P, N, 0, cuda, whole, muon, "deepspeed") if P else None,
        "formula_bytes": formula_bytes(row, P, N, g_ours, cuda, whole, muon) if P else None, "grad_bytes": g_ours,
        "ds_formula_bytes": formula_bytes(row, P, N, g_ds, cuda, whole, muon, "deepspeed") if P else None,
        "bucket_bytes": bucket, "optimizer": row.optimizer, "muon_params": muon,
        "whole_params": whole,
        "ours_comm_segment_bytes": next((m["comm_segment_bytes"] for m in ours.steps if "comm_segment_bytes" in m),
                                        None) if not ours.failed else None,
        "ours_peak": peak_of(ours, cuda), "ds_peak": peak_of(ds, cuda),
        "dloss_ds": loss_diff(ours, ds), "dloss_ddp": loss_diff(ours, ddp) if row.dtype == "fp32" else None,
    }


def div(a, b):
    return a / b if a is not None and b else None


def summary(results, args, have_ds) -> List[dict]:
    ddp = {r.dtype: ref for r, _, _, _, ref, _ in results if ref is not None and ref.impl == "ddp"}
    recs = [record(row, ours, ds, st0, ref, ddp.get(row.dtype), floor, args)
            for row, ours, ds, st0, ref, floor in results]
    mib = lambda x: fmt(x * MB if x else None, ".2f")  # noqa: E731
    print()
    print("step time (median s/step) and ratios; < 1 means ours is faster; floor = forward + backward alone "
          "(no engine, no communication, no optimizer) stepped round-robin with the engines in the same row")
    print(f"{'config':14} {'ours':>7} {'DeepSpeed':>9} {'floor':>7} {'ours/DS':>7} {'o-f':>7} {'DS-f':>7} "
          f"{'(o-f)/(DS-f)':>12} {'vs st0':>7} {'vs torch':>10} {'1st step ours':>13} {'1st step DS':>11}")
    for r in recs:
        vs_torch = ratio(r["ours_s"], r["torch_s"]) + (f" {r['torch']}" if r["torch"] else "")
        print(f"{r['config']:14} {fmt(r['ours_s']):>7} {fmt(r['ds_s']):>9} {fmt(r['floor_s']):>7} "
              f"{ratio(r['ours_s'], r['ds_s']):>7} {fmt(r['ours_above_floor_s']):>7} "
              f"{fmt(r['ds_above_floor_s']):>7} {fmt(r['overhead_ratio'], '.2f'):>12} "
              f"{ratio(r['ours_s'], r['st0_s']):>7} {vs_torch:>10} {fmt(r['ours_first_s'], '.1f'):>13} "
              f"{fmt(r['ds_first_s'], '.1f'):>11}")
    print("o-f, DS-f = median over rounds of (engine step - floor step in the same round); (o-f)/(DS-f) = "
          "our engine's own cost over DeepSpeed's (goal <= 0.5)")
    print()
    print(f"bytes per rank (MiB{', on the GPU' if args.cuda else ''}, the rank holding most): between steps "
          f"(after the optimizer step) against f0 = ZeRO's bytes for Adam without gradients (f0 DS: DeepSpeed's, "
          f"where its masters are a second copy); at forward's "
          f"peak ({'max_memory_allocated over the forward' if args.cuda else 'end of forward: live tensors plus the activations autograd saved'})")
    print(f"{'config':16} {'between ours':>12} {'DS':>8} {'f0':>8} {'f0 DS':>8} {'ours/f0':>7} {'DS/f0 DS':>8} "
          f"{'fwd peak ours':>13} {'DS':>8} {'ours/DS':>7} {'floor':>8}")
    for r in recs:
        f0, f0ds = r["between_formula_bytes"], r["ds_between_formula_bytes"]
        print(f"{r['config']:16} {mib(r['ours_between']):>12} {mib(r['ds_between']):>8} {mib(f0):>8} {mib(f0ds):>8} "
              f"{ratio(r['ours_between'], f0):>7} {ratio(r['ds_between'], f0ds):>8} {mib(r['ours_forward']):>13} "
              f"{mib(r['ds_forward']):>8} {ratio(r['ours_forward'], r['ds_forward']):>7} "
              f"{mib(r['floor_forward']):>8}")
    print()
    print(f"bytes per rank after backward (MiB){' on the GPU' if args.cuda else ''}; f = ZeRO's bytes for Adam with "
          f"the gradient-accumulation dtype each side uses (g: bytes per gradient element), bkt = one bucket of "
          f"min(reduce_bucket_size, P) elements")
    print(f"{'config':14} {'ours':>8} {'DS':>8} {'ours/DS':>7} {'f':>8} {'g':>3} {'ours/(f+bkt)':>12} "
          f"{'DS f':>7} {'DS/(f+bkt)':>10} {'peak ours':>9} {'peak DS':>8} {'|dloss| DS':>10} {'|dloss| DDP':>11}")
    for r in recs:
        fb = r["formula_bytes"] + r["bucket_bytes"] if r["formula_bytes"] is not None else None
        fbd = r["ds_formula_bytes"] + r["bucket_bytes"] if r["ds_formula_bytes"] is not None else None
        print(f"{r['config']:14} {mib(r['ours_bytes']):>8} {mib(r['ds_bytes']):>8} "
              f"{ratio(r['ours_bytes'], r['ds_bytes']):>7} {mib(r['formula_bytes']):>8} {r['grad_bytes']:>3} "
              f"{ratio(r['ours_bytes'], fb):>12} {mib(r['ds_formula_bytes']):>7} {ratio(r['ds_bytes'], fbd):>10} "
              f"{fmt(r['ours_peak'] * MB if r['ours_peak'] else None, '.1f'):>9} "
              f"{fmt(r['ds_peak'] * MB if r['ds_peak'] else None, '.1f'):>8} "
              f"{fmt(r['dloss_ds'], '.1e'):>10} {fmt(r['dloss_ddp'], '.1e'):>11}")
    print(f"peak = {'torch.cuda.max_memory_allocated over the run' if args.cuda else 'growth of the resident set (ru_maxrss) over the run, everything included'}; "
          f"|dloss| = max over steps of |rank-0 loss difference| (DDP: fp32 rows, torch.optim.AdamW)")
    muon_table(recs)
    seg = max((r["ours_comm_segment_bytes"] or 0 for r in recs), default=0)
    if seg:
        print(f"not counted above: dslaunch's shared-memory segment for same-host collectives, {mib(seg)} MiB per "
              f"group (mapped by every rank of it; a transport buffer, as gloo's and NCCL's own, which no tensor shows)")
    for r in recs:
        if r["whole_params"]:
            print(f"stage 3 keeps {r['whole_params']} of {r['params']} parameters whole (at most the persistence "
                  f"threshold each; see --persistence); f counts them whole")
            break
    return recs

def muon_table(recs) -> None:
    """Muon rows beside the same config's Adam row (when both ran): between-steps bytes,
    optimizer state by the formula, and step time."""
    adam = {r["config"]: r for r in recs if r["optimizer"] == "adam"}
    muon = [r for r in recs if r["optimizer"] == "muon"]
    if not muon:
        return
    mib = lambda x: fmt(x * MB if x else None, ".2f")  # noqa: E731
    print()
    print("Muon rows: optimizer state by the formula = 4 bytes x Muon elements + 8 x the rest (Adam: 8 x all), "
          "per rank after ZeRO's 1/N; between = measured bytes per rank between steps; Adam = the same config's "
          "Adam row")
    print(f"{'config':16} {'Muon elems':>10} {'of P':>6} {'state/Adam':>10} {'between ours':>12} {'DS':>8} "
          f"{'Adam ours':>9} {'ours/Adam':>9} {'s/step ours':>11} {'DS':>7} {'ours/DS':>7}")
    for r in muon:
        base = adam.get(r["config"][:-len("-muon")])
        P, Pm = r["params"], r["muon_params"]
        state = (4 * Pm + 8 * (P - Pm)) / (8 * P) if P else None
        print(f"{r['config']:16} {Pm or 0:>10} {fmt(Pm / P if P else None, '.2f'):>6} {fmt(state, '.3f'):>10} "
              f"{mib(r['ours_between']):>12} {mib(r['ds_between']):>8} "
              f"{mib(base['ours_between'] if base else None):>9} "
              f"{ratio(r['ours_between'], base['ours_between'] if base else None):>9} {fmt(r['ours_s']):>11} "
              f"{fmt(r['ds_s']):>7} {ratio(r['ours_s'], r['ds_s']):>7}")


if __name__ == "__main__":
    sys.exit(main())
