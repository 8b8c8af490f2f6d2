"""The runtime's side of `dslaunch --autotuning`: measure a trial, then stop it cleanly.

A trial is the user's own script launched with a generated config and two variables
(set by dslaunch.launcher.autotune.trial; names shared with it):
DSLAUNCH_TRIAL_DIR, where each rank writes metrics_rank<N>.json, and DSLAUNCH_TRIAL_STEPS
"start:end", DeepSpeed's start_profile_step and end_profile_step. The steps after
`start` up to `end` are timed; the forward passes of the step before them are watched with
autograd's saved-tensor hooks, so the activation bytes are measured rather than guessed.
Where the model checkpoints activations (deepspeed.checkpointing.checkpoint), that step
also counts the inputs each segment keeps and what each segment's recompute saves in
backward: the launcher's memory model (launcher/autotune/memory.py activation_model)
predicts from them the activations with checkpointing on and off.

Where the trial runs at tensor-parallel degree 1, it also asks AutoTP (pure planning, the
model unchanged) at which degrees dividing the data-parallel ranks it could split the model,
and how many parameters each split shards: the launcher tunes those degrees
(tensor_parallel.autotp_size) and its memory model counts the shard.

How the trial stops: when step `end` completes, engine.step() raises TrialComplete. It
derives from BaseException, not Exception, for the reason SystemExit and
KeyboardInterrupt do: training loops (the Hugging Face Trainer's among them) catch
Exception to log or retry, and must not swallow a stop. `finally` blocks and context
managers still run, so the script unwinds as it would on Ctrl-C, with no exit() in the
middle of user code; the trial wrapper (launcher/autotune/worker.py) catches it at the
top and the process ends normally (exit 0, the runtime's orderly shutdown at exit). A
flag the loop would have to poll was the alternative: no existing training loop reads
one, so every trial would run the script's whole training.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from ...core.comm import shm, shm_p2p
from ...tensor_parallel import TensorParallelError
from ...tensor_parallel.autotp import plan_training_shards

TRIAL_DIR_VAR = "DSLAUNCH_TRIAL_DIR"  # launcher/autotune/trial.py TRIAL_DIR_VAR
TRIAL_STEPS_VAR = "DSLAUNCH_TRIAL_STEPS"  # launcher/autotune/trial.py TRIAL_STEPS_VAR


class TrialComplete(BaseException):
    """The autotuning trial measured what it needed: unwind the script and exit 0."""


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (CPU or device), the
    communication segments of same-host groups and rings of same-host pipeline stages aside
    (comm/shm.py, comm/shm_p2p.py: transport buffers)."""
    buffers = {**shm.buffer_pointers(), **shm_p2p.buffer_pointers()}
    seen, total = {(torch.device("cpu"), ptr) for ptr in buffers}, 0
    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated module objects warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            if obj.is_meta:
                continue
            storage = obj.untyped_storage()
            key = (storage.device, storage.data_ptr())
        except Exception:  # sparse, functional or otherwise storage-less tensors
            continue
        if key not in seen and storage.data_ptr():
            seen.add(key)
            total += storage.nbytes()
    return total


def _host_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def autotp_report(model, ranks: int, partition_config=None) -> dict:
    """{"split": {degree: parameters AutoTP splits}, "refused": why not at the first degree it
    cannot} over the degrees above 1 that divide `ranks`; the model is only planned, not changed."""
    split, refused = {}, ""
    for degree in (d for d in range(2, ranks + 1) if ranks % d == 0):
        try:
            plan = plan_training_shards(model, degree, partition_config)
        except TensorParallelError as exc:
            refused = refused or f"degree {degree}: {str(exc).removeprefix('tensor parallel: ')}"
            continue
        seen, n = set(), 0
        for d in plan.decisions:
            module = model.get_submodule(d.name)
            # a column layer's bias is split with its outputs; a row layer's is added whole
            for p in (module.weight, getattr(module, "bias", None) if d.kind == "column" else None):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        split[degree] = n
    if ranks < 2:
        refused = "a single data-parallel rank: no degree above 1 divides it"
    return {"split": split, "refused": refused}


class TrialProbe:
    """Times steps start..end, measures activations and memory, writes the metrics, stops."""

    def __init__(self, engine, out_dir: str, start: int, end: int):
        self.engine, self.out_dir, self.start, self.end = engine, Path(out_dir), start, end
        self.t0: Optional[float] = time.perf_counter() if start == 0 else None  # start 0: from initialize()
        # in the measured step's (last) micro-batch: bytes the forward saved for backward outside
        # checkpointed segments, the inputs the segments kept, and what each recompute saved
        self.forward_saved = 0
        self.kept_bytes = 0
        self.segments: list = []
        # micro-batches whose activations are held at once: 1, or a pipeline stage's buffers
        # (1F1B keeps up to stages - stage_id forwards waiting for their backward)
        self.in_flight = 1
        self._seen: set = set()
        self._params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        self._baseline = 0  # set by the engine: see baseline()
        # CPU: live bytes after the last timed step's backward, when the gradients exist (the
        # step frees them, so a count after it would miss them), and the seconds that count
        # took, which are not the configuration's and come off the timed span
        self.held_after_backward: Optional[int] = None
        self.untimed = 0.0
        self._checkpointing = None

    @staticmethod
    def baseline(model) -> Optional[int]:
        """Under a trial, at the start of initialize(): the bytes of the tensors the script
        holds apart from the model (its data set, often), which are not the configuration's
        memory and are left out of the measured bytes. None when not a trial."""
        if not os.environ.get(TRIAL_DIR_VAR) or torch.cuda.is_available():
            return None  # (on a GPU the device's own peak allocation is measured instead)
        params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        return _live_tensor_bytes() - sum(params.values())

    @classmethod
    def from_env(cls, engine, baseline: Optional[int] = None, checkpointing=None) -> Optional["TrialProbe"]:
        """The probe of this trial, or None outside one. `checkpointing`, the engine's
        activation-checkpointing module, reports what each checkpointed segment keeps and
        recomputes to its `observer`: the probe is that observer until the trial ends."""
        out = os.environ.get(TRIAL_DIR_VAR)
        if not out:
            return None
        start, _, end = os.environ.get(TRIAL_STEPS_VAR, "").partition(":")
        probe = cls(engine, out, int(start), int(end))
        probe._baseline = baseline or 0
        probe._checkpointing = checkpointing
        if checkpointing is not None:
            checkpointing.observer = probe
        return probe

    @property
    def peak_saved(self) -> int:
        """Activation bytes at their peak: what each micro-batch in flight saved and its
        segments kept, plus the largest segment's recompute in backward (one at a time)."""
        return (self.forward_saved + self.kept_bytes) * self.in_flight + max(self.segments, default=0)

    def _measuring(self) -> bool:
        # the activations of one step: the last one before the timed steps, so that the hooks
        # cost them nothing (the first timed one when start_profile_step is 0)
        return self.engine.global_steps == max(0, self.start - 1)

    def _new_bytes(self, t, seen: set) -> int:
        """t's storage bytes unless it is a weight (model state, not activations) or counted."""
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except Exception:
            return 0
        if ptr in self._params or ptr in seen or not ptr:
            return 0
        seen.add(ptr)
        return storage.nbytes()

    @contextlib.contextmanager
    def _counting(self, add):
        seen: set = set()

        def pack(t):
            add(self._new_bytes(t, seen))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield seen

    @contextlib.contextmanager
    def forward(self):
        if not self._measuring():
            yield
            return
        self.forward_saved, self.kept_bytes, self.segments = 0, 0, []

        def add(n):
            self.forward_saved += n

        with self._counting(add) as seen:
            self._seen = seen  # shared with kept(): an input both kept and saved counts once
            yield

    def kept(self, tensors) -> None:
        """deepspeed.checkpointing: the inputs a segment keeps until its recompute."""
        if self._measuring():
            self.kept_bytes += sum(self._new_bytes(t, self._seen) for t in tensors if isinstance(t, torch.Tensor))

    @contextlib.contextmanager
    def recompute(self):
        """deepspeed.checkpointing: around one segment's recompute in backward."""
        if not self._measuring():
            yield
            return
        saved = [0]

        def add(n):
            saved[0] += n

        with self._counting(add):
            yield
        self.segments.append(saved[0])

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def after_backward(self) -> None:
        """After each boundary backward: on the CPU, count the live tensors once, in the last
        timed step, where parameters, gradients and optimizer state are all held."""
        if self.engine.device.type == "cuda" or self.engine.global_steps != self.end - 1:
            return
        t = time.perf_counter()
        gc.collect()  # tensors only an uncollected reference cycle holds are not the configuration's
        self.held_after_backward = _live_tensor_bytes()
        self.untimed += time.perf_counter() - t

    def step_done(self) -> None:
        """After each optimizer step: start the clock at `start`, finish at `end`."""
        steps = self.engine.global_steps
        if steps == self.start:
            self._sync()
            self.t0 = time.perf_counter()
            if self.engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.engine.device)
        elif steps >= self.end:
            if steps == self.end:
                self._sync()
                self.write(time.perf_counter() - self.t0 - self.untimed)
            if self._checkpointing is not None and self._checkpointing.observer is self:
                self._checkpointing.observer = None
            # again at every later step, should a bare `except:` in the script have caught it
            raise TrialComplete(f"autotuning trial measured steps {self.start + 1}-{self.end}")

    def write(self, elapsed: float) -> None:
        e = self.engine
        steps = self.end - self.start
        b = e.batch
        params = sum(getattr(p, "ds_numel", p.numel()) for p in e.module.parameters())
        cuda = e.device.type == "cuda"
        if cuda:
            free, _total = torch.cuda.mem_get_info(e.device)
            limit = free + torch.cuda.memory_reserved(e.device)
            measured = torch.cuda.max_memory_allocated(e.device)
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            available = _host_available()
            limit = None if available is None else available // max(1, local)
            gc.collect()  # tensors only an uncollected reference cycle holds are not the configuration's
            held = max(_live_tensor_bytes(), self.held_after_backward or 0)
            measured = held - self._baseline + self.peak_saved
        # samples per step: not b.train_batch_size, which under AutoTP counts tensor-parallel ranks
        # as DeepSpeed's does
        samples = b.micro_batch_per_gpu * b.gradient_accumulation_steps * e.dp_world_size
        metrics = {
            "rank": e.global_rank, "steps": steps, "elapsed_s": elapsed,
            "throughput": samples * steps / elapsed, "latency": elapsed / steps,
            "train_batch_size": samples, "micro_batch": b.micro_batch_per_gpu,
            "gradient_accumulation_steps": b.gradient_accumulation_steps, "zero_stage": e.zero_optimization_stage(),
            "dp": e.dp_world_size, "params": params,
            "activation_bytes_per_sample": self.peak_saved / b.micro_batch_per_gpu,
            "forward_saved_bytes_per_sample": self.forward_saved / b.micro_batch_per_gpu,
            "checkpoint_input_bytes_per_sample": self.kept_bytes / b.micro_batch_per_gpu,
            "checkpoint_segment_bytes_per_sample": [n / b.micro_batch_per_gpu for n in self.segments],
            "measured_bytes": measured, "memory_limit_bytes": limit, "device": e.device.type,
            "tp": e.config.tensor_parallel.size, "micro_batches_in_flight": self.in_flight,
        }
        if metrics["tp"] == 1:
            metrics["autotp"] = autotp_report(e.module, e.dp_world_size, e.config.tensor_parallel.partition_config)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / f".metrics_rank{e.global_rank}.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=1))
        tmp.replace(self.out_dir / f"metrics_rank{e.global_rank}.json")
