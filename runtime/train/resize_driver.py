"""What the engine does at each optimizer step and at initialize() in a resizable job.

initialize() attaches it to the engine it built (the engine imports no checkpoint policy of
its own: it calls the driver it was given).

At initialize() (resume): when $DSLAUNCH_SAVE_DIR holds a complete checkpoint (`latest`),
every rank loads it, at whatever world size this attempt has: ZeRO state, optimizer state
and tensor slices are re-cut by the checkpoint loader, the counters and the data loader's
sample offset come back, so the script continues where the checkpoint left it.

After each optimizer step (after_step):
  1. the requests the node agent forwarded ("drain", "grow") are agreed on by every rank: one
     all_reduce(MAX) of two flags over the world group, so all ranks act at the same step
     (a request reaches each host's ranks at a different moment);
  2. every $DSLAUNCH_SAVE_EVERY steps, and at once on a drain, every rank saves
     SAVE_DIR/global_stepN (the commit is atomic: `latest` always names a complete one);
     the two newest global_stepN checkpoints are kept, older ones removed;
  3. the step and the last saved step go to the agent (for the launcher's messages);
  4. on a drain (now) or a grow (after the next periodic checkpoint) the job stops: the
     next forward (or train_batch) raises SystemExit(RESIZE_EXIT_CODE). Not at once: the
     script still logs the step it just finished. SystemExit, so `finally` blocks run and no
     `except Exception` in a training loop swallows it; a loop that ends first ends the job
     as usual. The launcher then starts the job at its new size.
Without an agent (a job with --checkpoint_dir that is not elastic) only step 2 happens.
"""
from __future__ import annotations

import os
import re
import sys
from typing import List, Optional

import torch

from ..core import comm
from .checkpoint.agree import agree
from .checkpoint.files import remove_tree
from .checkpoint.layout import read_latest
from .resize import batch as resize_batch
from .resize.contract import RESIZE_EXIT_CODE, ResizeEnv
from .resize.link import AgentLink

KEEP = 2  # newest global_stepN checkpoints kept in the save directory
_TAG = re.compile(r"^global_step(\d+)$")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def stale_tags(names: List[str], keep: int = KEEP) -> List[str]:
    """The global_stepN names to remove so that the `keep` newest stay (others are left alone)."""
    steps = sorted((int(m.group(1)), n) for n in names if (m := _TAG.match(n)))
    return [n for _, n in steps[:-keep]] if keep else [n for _, n in steps]


def next_save(step: int, every: Optional[int]) -> int:
    """The first periodic checkpoint step after `step` (the step itself when it is one)."""
    if not every:
        return step
    return -(-step // every) * every


class ResizeDriver:
    def __init__(self, engine, env: ResizeEnv):
        self.engine = engine
        self.env = env
        self.saved: Optional[int] = None  # the step of the newest checkpoint this job wrote or resumed from
        self._grow = False  # a grow was agreed: stop after the next periodic checkpoint
        self.stopping = False  # saved for a resize: the next forward ends the process
        self.link = AgentLink(env.agent_socket, engine.global_rank) if env.agent_socket else None
        if self.link is not None:
            self.link.send({"hello": True, "facts": self.facts()})

    def facts(self) -> dict:
        """What the launcher needs to plan only sizes this job can run at (launcher/elastic.py Facts)."""
        e = self.engine
        if self.env.base_world is None:
            return {}
        model = e.world_size // e.dp_world_size
        if e.config.elasticity.enabled:
            table = resize_batch.world_table(e.config, e.world_size, e.dp_world_size, self.env.base_world,
                                             self.env.max_world or max(e.world_size, self.env.base_world))
            return {"sizes": {str(w): list(v) for w, v in table.items()}, "model": model}
        b = e.batch
        return {"batch": b.train_batch_size, "micro": b.micro_batch_per_gpu, "model": model}

    # -- initialize() ------------------------------------------------------------------------
    def resume(self) -> None:
        e = self.engine
        if self.env.save_dir is None:
            return
        error, tag = None, None
        try:
            tag = read_latest(self.env.save_dir)
        except Exception as exc:  # an unreadable `latest` is every rank's one-line error, said by agree
            error = str(exc)
        if not any(agree(error, tag is not None)):
            return
        path, _ = e.load_checkpoint(self.env.save_dir)
        self.saved = e.global_steps
        restart_loader = getattr(e, "_restart_data_iterator", None)
        if restart_loader is not None:
            restart_loader()
        if e.global_rank == 0:
            b = e.batch
            print(f"dslaunch: resumed from {path} at step {e.global_steps:,} on {e.world_size} rank(s) "
                  f"({e.dp_world_size} data-parallel): global batch {b.train_batch_size} = micro batch "
                  f"{b.micro_batch_per_gpu} x accumulation {b.gradient_accumulation_steps} x {e.dp_world_size}",
                  file=sys.stderr, flush=True)
        if self.link is not None:
            self.link.send({"step": e.global_steps, "saved": self.saved})

    # -- every optimizer step ----------------------------------------------------------------
    def _requests(self):
        """(drain, grow) as every rank agrees on them at this step."""
        if self.link is None:
            return False, False
        got = self.link.requests()
        e = self.engine
        flags = torch.tensor([float("drain" in got), float("grow" in got)], device=e.device)
        if comm.is_initialized() and comm.get_world_size() > 1:
            comm.all_reduce(flags, op=comm.ReduceOp.MAX, group=comm.get_world_group(), label="resize requests")
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def after_step(self) -> None:
        e = self.engine
        step = e.global_steps
        drain, grow = self._requests()
        every = self.env.save_every
        periodic = bool(every) and step % every == 0
        if grow and not self._grow:
            self._grow = True
            self._say(f"a host joins: stopping after the checkpoint at step {next_save(step, every):,} "
                      "to grow the job")
        stop = drain or (self._grow and (periodic or not every))
        if drain:
            self._say(f"drain requested: {'saving at' if self.env.save_dir else 'stopping without a checkpoint at'} "
                      f"step {step:,} to shrink the job")
        if self.env.save_dir is not None and (periodic or stop):
            self._save(step)
        if self.link is not None:
            self.link.send({"step": step, "saved": self.saved})
        self.stopping = stop

    def check_stop(self) -> None:
        """Called as the next step begins: leave for the resize the job agreed on."""
        if self.stopping:
            raise SystemExit(RESIZE_EXIT_CODE)

    def _save(self, step: int) -> None:
        e = self.engine
        e.save_checkpoint(self.env.save_dir, tag=tag_for(step))
        self.saved = step
        if e.global_rank == 0:
            try:
                names = os.listdir(self.env.save_dir)
            except OSError:
                return
            for name in stale_tags(names):
                remove_tree(os.path.join(self.env.save_dir, name))

    def _say(self, text: str) -> None:
        if self.engine.global_rank == 0:
            print(f"dslaunch: {text}", file=sys.stderr, flush=True)
