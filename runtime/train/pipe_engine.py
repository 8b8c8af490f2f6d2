"""PipelineEngine: what `initialize` returns for a PipelineModule.

    loss = engine.train_batch(data_iter)       # gradient_accumulation_steps micro-batches, one step
    loss = engine.eval_batch(data_iter)        # forward only, same batch size

Each stage runs its schedule (pipe/schedule.py; chosen by name in the config's
`pipeline.schedule`: DeepSpeed's 1F1B by default, ZB-H1 or interleaved 1F1B) instruction by
instruction: this engine executes instructions and knows no schedule. Only the
first stage reads inputs and only the last reads labels, each `next(data_iter)` giving one
micro-batch `(inputs, labels)`; the other stages never touch data. The last stage computes
`loss_fn(outputs, labels)` (or takes the output as the loss), scales it by the fp16 loss
scale and 1/gradient_accumulation_steps and runs backward; gradients flow upstream through
p2p.py. Everything the base engine does at the accumulation boundary then happens once
per batch on every stage: gradients are reduced over the stage's data-parallel group by
the ZeRO strategy (stage 0, 1 or 2), weights tied across stages get their gradients summed
over the tie group, the gradient norm for clipping and fp16 overflow is summed over all
stages and replicas, and the optimizer and LR scheduler step. The returned loss is the
mean over the batch's micro-batches and data-parallel replicas, the same on every rank.

ZeRO stage 3 is refused: a stage already holds only its own layers, and stage 3's
gather-around-forward hooks assume one forward then its backward, which 1F1B interleaves.

A schedule that splits backward (ZB-H1) runs each micro-batch's forward through
PipelineModule.forward_split (one graph per layer); its BackwardInput takes the gradient of
every layer's input, layer by layer from the last, keeping each layer's output gradient;
its BackwardWeight then takes each layer's weight gradients from those alone. A schedule of
several model chunks (interleaved) names the chunk in every instruction: buffers and links
are per (chunk, micro-batch) and per chunk.

The pipeline engine holds a DeepSpeedEngine (built from the same arguments) rather than
being one: the engine does what it does for any model (config, precision, the ZeRO strategy,
the optimizer step at the boundary, checkpoints, logging) and this class runs schedules on
top. What a script reaches that the pipeline does not answer itself is the engine's, by
delegation (see __getattr__). DeepSpeed's PipelineEngine subclasses its DeepSpeedEngine, so
scripts and Hugging Face test isinstance(engine, DeepSpeedEngine): this class is registered
as a virtual subclass (DeepSpeedEngine is an ABC for that alone), and is an nn.Module whose
only submodule is the stage's module, under the name the engine gives it.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Dict, List, Optional

import torch

from .accumulation import check_accumulation_mode
from ..core import comm
from .dataloader import RepeatingLoader, move_to
from ..core.errors import CoalesceUnsupportedError
from ..core.internals import ROLES_ATTRIBUTE, engine_roles
from ..core.config import DeepSpeedConfig
from .engine import DeepSpeedEngine, _config_source
from ..core.strict import ConfigError
from ..pipe import schedule as S
from ..pipe.module import Piece, PipelineError, PipelineModule, detach_floating
from ..pipe.p2p import AbortNotice, StageLink, floating, share_memory
from .activation_checkpointing import checkpointing


# nn.Module's own bookkeeping, which both objects have: never written through to the engine
_MODULE_STATE = frozenset(vars(torch.nn.Module()))


@DeepSpeedEngine.register  # isinstance(engine, DeepSpeedEngine) holds, as for DeepSpeed's subclass
class PipelineEngine(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        model = kwargs.get("model")
        if not isinstance(model, PipelineModule):
            raise PipelineError("PipelineEngine: the model must be a deepspeed.pipe.PipelineModule")
        empty = [s for s, n in enumerate(model.stage_param_counts()) if n == 0]
        if empty:  # checked on every rank alike, before any collective
            parts, names = model.parts, model.layer_names()
            s = empty[0]
            where = f"stage {s}" if model.virtual_stages == 1 else f"virtual stage {s}"
            raise PipelineError(f"pipeline: {where} (layers {parts[s]}-{parts[s + 1] - 1}: "
                                f"{', '.join(names[parts[s]:parts[s + 1]])}) has no trainable parameters for its "
                                "optimizer; use fewer stages or partition_method=\"parameters\"")
        # refused before the engine builds anything (every rank reads the same config)
        source = _config_source(kwargs.get("args"), kwargs.get("config"), kwargs.get("config_params"))
        loaded = DeepSpeedConfig.load(source)
        schedule_name = _checked_schedule(loaded.pipeline.schedule, model)
        check_accumulation_mode(loaded, pipeline=True)
        if loaded.zero_optimization.stage == 3:
            raise ConfigError("zero_optimization.stage: ZeRO stage 3 cannot run under pipeline parallelism "
                              "(each stage already holds only its layers, and stage 3's gather-around-forward "
                              "does not follow 1F1B's interleaved micro-batches); use stage 1 or 2")
        super().__init__()
        engine = DeepSpeedEngine(*args, **kwargs)
        # kept out of nn.Module's registry: the stage's module is registered here under the
        # engine's name for it, so parameters and state_dict keys read "module.<name>" as DeepSpeed's
        object.__setattr__(self, "_engine", engine)
        engine.pipeline_parallelism = True  # DeepSpeed's flag, read through this engine's attributes
        if engine.optimizer is not None:  # DeepSpeed's pipeline engine wraps bf16 at stage 0 in a ZeROOptimizer
            setattr(engine.optimizer, ROLES_ATTRIBUTE, engine_roles(loaded.zero_optimization.stage,
                                                                    engine.compute_dtype, pipeline=True))
        self.module = engine.module
        use_reentrant = engine.config.pipeline.use_reentrant
        if use_reentrant is False:
            model.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
        elif use_reentrant and model.activation_checkpoint_func is None:
            model.activation_checkpoint_func = checkpointing.checkpoint  # as DeepSpeed: a module's own func stays
        if engine.config.pipeline.activation_checkpoint_interval > 0:
            model.set_checkpoint_interval(engine.config.pipeline.activation_checkpoint_interval)
        self.num_stages = engine.grid.get_pipe_parallel_world_size()
        self.stage_id = engine.grid.get_stage_id()
        self.micro_batches = engine.batch.gradient_accumulation_steps
        self.micro_batch_size = engine.batch.micro_batch_per_gpu
        self.schedule_name, self.chunks = schedule_name, model.virtual_stages
        if self.schedule_name in S.CHUNKED and self.micro_batches % self.num_stages:
            raise ConfigError(f"pipeline.schedule: {self.schedule_name!r} needs gradient_accumulation_steps "
                              f"({self.micro_batches}) to be a multiple of the pipeline stages ({self.num_stages})")
        if self.schedule_name in S.SPLIT and model.activation_checkpoint_interval > 0:
            raise ConfigError(f"pipeline.schedule: {self.schedule_name!r} splits each layer's backward in two and "
                              "cannot recompute checkpointed layers in between; set activation_checkpoint_interval "
                              "to 0 or use \"1f1b\"")
        self._stage_links: Dict[Any, StageLink] = {}
        first_chunk = S.PipeSchedule(1, self.num_stages, self.stage_id).link(0)
        self.link = self._link(first_chunk, False)  # 1F1B's and the inference schedule's
        self._links: List[StageLink] = [self.link]
        # stages on one host pass activations and gradients through shared memory; every flow
        # of every chunk is set up now, with the whole pipeline group (a collective)
        self.shared_memory_flows: List[Any] = []
        if self.num_stages > 1:
            sched = S.train_schedule(self.schedule_name, self.micro_batches, self.num_stages,
                                     self.stage_id, self.chunks)
            self.shared_memory_flows = share_memory([sched.link(c) for c in range(self.chunks)],
                                                    engine.grid.stage_to_global, engine.grid.get_pipe_parallel_group())
        self.data_iterator = None
        if engine.training_dataloader is not None:
            # DeepSpeed's pipeline reads training_data in order (no shuffling); the first and
            # last stage of a pipeline must see the same samples, and do with the same sampler.
            # The engine keeps it: its checkpoints record the loader's position.
            loader = engine.training_dataloader
            engine.training_dataloader = engine.deepspeed_io(loader.dataset, loader.batch_size,
                                                             collate_fn=loader.loader.collate_fn, shuffle=False)
        if engine.training_dataloader is not None and self._reads_data():
            self.data_iterator = RepeatingLoader(engine.training_dataloader)
        self.batch_fn = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        self._boundary_flag = False
        self._compute_loss = True
        self.eval_return_logits = False
        self.has_attention_mask = type(model).__name__ == "GPT2ModelPipe"  # DeepSpeed's default
        self.outputs = None
        self._grads: Optional[List[torch.Tensor]] = None
        # seconds of the last batch: forward+backward (compute), sends and receives including
        # the wait for the neighbour (p2p), reductions and optimizer step (step), all (total);
        # and time.perf_counter() at the schedule's start and at the end of its last forward or
        # backward pass (start, compute_end: one clock for every process of a host)
        self.step_timings: Dict[str, float] = {}
        if engine.global_rank == 0:
            self._print_layout(model)

    # -- the engine's surface, by delegation -------------------------------------------------------
    # Everything DeepSpeedEngine offers a script (config accessors, counters, checkpoints, the
    # optimizer and scheduler, get_lr, ...) is the held engine's: read through __getattr__, and
    # an attribute the engine holds is written there too (engine.global_steps = n,
    # initialize's engine._resize), so there is one copy of each. What the pipeline answers
    # differently is defined on this class and found first.
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            pass
        engine = self.__dict__.get("_engine")
        if engine is None:  # before the engine exists (or in copy/pickle's bare instance)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(engine, name)

    def __setattr__(self, name: str, value) -> None:
        engine = self.__dict__.get("_engine")
        if engine is not None and name not in self.__dict__ and name not in _MODULE_STATE and name in vars(engine):
            setattr(engine, name, value)
        else:
            super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(dir(self.__dict__.get("_engine", None) or object())))

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """The engine's, and the pipeline runs that many micro-batches per train_batch()."""
        before = self._engine.batch
        self._engine.set_train_batch_size(train_batch_size)
        micro = self._engine.batch.gradient_accumulation_steps
        if self.schedule_name in S.CHUNKED and micro % self.num_stages:
            self._engine.batch = before
            raise ConfigError(f"set_train_batch_size({train_batch_size}): {micro} micro-batches, and schedule "
                              f"{self.schedule_name!r} needs a multiple of the pipeline stages ({self.num_stages})")
        self.micro_batches = micro

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's switch for sending a boolean mask between stages; here tensors of every
        dtype travel between stages as they are, so only the value is kept (has_attention_mask)."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask({value!r}): a bool")
        self.has_attention_mask = value

    # nn.Module methods the engine answers itself (found on nn.Module first, so named here)
    def zero_grad(self, *args, **kwargs):
        return self._engine.zero_grad(*args, **kwargs)

    def train(self, mode: bool = True):
        self._engine.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def compile(self, *args, **kwargs):
        return self._engine.compile(*args, **kwargs)

    def _print_layout(self, model: PipelineModule) -> None:
        names, parts, p = model.layer_names(), model.parts, self.num_stages

        def where(k):
            return f"stage {k}" if self.chunks == 1 else f"stage {k % p} chunk {k // p}"
        stages = "; ".join(f"{where(k)}: layers {parts[k]}-{parts[k + 1] - 1} "
                           f"({', '.join(names[parts[k]:parts[k + 1]])})" for k in range(len(parts) - 1))
        print(f"pipeline: {self.num_stages} stages x {self._engine.dp_world_size} data-parallel, "
              f"{self.micro_batches} micro-batches of {self.micro_batch_size}; {stages}; "
              f"schedule {self.schedule_name}", flush=True)

    def _link(self, link: S.Link, async_sends: bool) -> StageLink:
        """The StageLink for one chunk's neighbours and tags (made once, kept: it remembers
        the shapes described in the current batch)."""
        key = (link, async_sends)
        if key not in self._stage_links:
            rank = (lambda st: None if st is None else self._engine.grid.stage_to_global(st))
            self._stage_links[key] = StageLink(rank(link.prev_stage), rank(link.next_stage), self._engine.device,
                                               dynamic_shape=self.module.dynamic_shape,
                                               tags=(link.recv_act_tag, link.send_act_tag, link.recv_grad_tag,
                                                     link.send_grad_tag), async_sends=async_sends)
        return self._stage_links[key]

    # -- DeepSpeed's accessors -----------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def _reads_data(self) -> bool:
        return self.is_first_stage() or self.is_last_stage()

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator) -> None:
        """The iterator train_batch() reads from (kept only by the first and last stages)."""
        if self._reads_data():
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        if self._reads_data():
            self._engine.training_dataloader = loader
            self.data_iterator = RepeatingLoader(loader)

    def _restart_data_iterator(self) -> None:
        """After a checkpoint moved the engine's loader (resize_driver.py resume): read on from
        its new position; an iterator the script set is the script's."""
        if isinstance(self.data_iterator, RepeatingLoader) and self.data_iterator.loader is self._engine.training_dataloader:
            self.data_iterator = RepeatingLoader(self._engine.training_dataloader)

    def set_batch_fn(self, fn) -> None:
        self.batch_fn = fn

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._boundary_flag

    def reset_activation_shape(self) -> None:
        for link in self._stage_links.values():
            link.new_batch()

    def forward(self, *args, **kwargs):
        raise PipelineError("pipeline: engine(batch) is not available in pipeline mode; use engine.train_batch() "
                            "or engine.eval_batch()")

    def backward(self, *args, **kwargs):
        raise PipelineError("pipeline: engine.backward() is not available in pipeline mode; use engine.train_batch()")

    def step(self, *args, **kwargs):
        raise PipelineError("pipeline: engine.step() is not available in pipeline mode; use engine.train_batch()")

    def no_sync(self):
        # DeepSpeed's pipeline accepts the block and reduces anyway: train_batch reduces and steps
        raise PipelineError("pipeline: no_sync() is not available in pipeline mode: train_batch() reduces the "
                            "gradients of its micro-batches and steps every call")

    def coalesce_grad_reduction(self):
        raise CoalesceUnsupportedError("coalesce_grad_reduction is not supported under pipeline parallelism: "
                                       "train_batch() reduces once per batch already")

    # -- batches ---------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Run one global batch and step; returns the mean loss (same on every rank)."""
        if self._engine._resize is not None:
            self._engine._resize.check_stop()
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch: gradients are disabled (torch.no_grad); use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._compute_loss = True
        self._engine.tput_timer.start()
        start = time.perf_counter()
        sched = S.train_schedule(self.schedule_name, self.micro_batches, self.num_stages, self.stage_id, self.chunks)
        if self._engine._trial is not None:
            self._engine._trial.in_flight = sched.activations_in_flight()
        losses = self._exec_schedule(sched)
        self.agg_train_loss = self._aggregate_loss(losses, self.micro_batches)
        self.step_timings["total"] = time.perf_counter() - start
        self._engine.tput_timer.stop(global_step=True)
        self._engine._meter.add_loss(float(self.agg_train_loss))
        self._engine._report_step()  # the log line and monitors, once the batch's loss is known
        if self._engine._resize is not None:
            self._engine._resize.after_step()
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True, reduce_output="avg",
                   bcast_loss: bool = True, num_micro_batches: Optional[int] = None):
        """Forward `num_micro_batches` (default: gradient_accumulation_steps) micro-batches
        through the InferenceSchedule under torch.no_grad; returns the mean loss (on every
        rank when bcast_loss), and the last micro-batch's outputs too with return_logits."""
        if reduce_output not in (None, "avg"):
            raise PipelineError(f"eval_batch: reduce_output={reduce_output!r}; use \"avg\" or None")
        if self._engine._resize is not None:
            self._engine._resize.check_stop()
        self.module.eval()
        self._compute_loss = compute_loss
        self.eval_return_logits = return_logits
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        m = num_micro_batches or self.micro_batches
        if self.chunks == 1:
            sched = S.InferenceSchedule(m, self.num_stages, self.stage_id)
        elif m % self.num_stages:
            raise PipelineError(f"eval_batch: {m} micro-batches through {self.chunks} model chunks per stage must be "
                                f"a multiple of the pipeline stages ({self.num_stages})")
        else:
            sched = S.ChunkedInferenceSchedule(m, self.num_stages, self.stage_id, self.chunks)
        try:
            with torch.no_grad():
                outs = self._exec_schedule(sched)
        finally:
            self.data_iterator = saved
        if reduce_output is None:
            result = outs if self.is_last_stage() else None
        elif compute_loss and bcast_loss:
            result = self._aggregate_loss(outs, m)
        else:
            result = self._mean_over_replicas(sum(outs) / m) if self.is_last_stage() else None
        self.module.train()
        if return_logits:
            logits, self.outputs = self.outputs, None
            return result, logits
        return result

    # -- execution -------------------------------------------------------------------------------
    def _exec_schedule(self, sched: S.PipeSchedule) -> List[torch.Tensor]:
        # buffers by (chunk, buffer id); "pieces": a split forward's layers until their W
        self._buf: Dict[str, Dict[Any, Any]] = {k: {} for k in ("inputs", "labels", "outputs", "loss", "pieces")}
        self._results: List[torch.Tensor] = []
        self._split = sched.split_backward and torch.is_grad_enabled()
        self._grad_passes = 0  # passes that accumulate weight gradients (B, or W when split)
        self._grad_passes_total = sched.micro_batches * sched.chunks
        self._links = [self._link(sched.link(c), sched.async_sends) for c in range(sched.chunks)]
        for link in self._links:
            link.new_batch()
        self._batch_data = self._prefetch(sched.micro_batches) if self._reads_data() else []
        handlers = {S.LoadMicroBatch: self._load, S.ForwardPass: self._forward, S.BackwardPass: self._backward,
                    S.BackwardInput: self._backward_input, S.BackwardWeight: self._backward_weight,
                    S.SendActivation: self._send_act, S.RecvActivation: self._recv_act, S.SendGrad: self._send_grad,
                    S.RecvGrad: self._recv_grad, S.ReduceTiedGrads: self._reduce_tied, S.ReduceGrads: self._reduce,
                    S.OptimizerStep: self._optimizer_step}
        comm_time = compute_time = step_time = 0.0
        self.step_timings["start"] = time.perf_counter()
        for step in sched:
            for cmd in step:
                t0 = time.perf_counter()
                handlers[type(cmd)](cmd)
                dt = time.perf_counter() - t0
                if isinstance(cmd, (S.ForwardPass, S.BackwardPass, S.BackwardInput, S.BackwardWeight)):
                    compute_time += dt
                    self.step_timings["compute_end"] = t0 + dt
                elif isinstance(cmd, (S.SendActivation, S.RecvActivation, S.SendGrad, S.RecvGrad)):
                    comm_time += dt
                elif isinstance(cmd, (S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep)):
                    step_time += dt
        t0 = time.perf_counter()
        for link in self._links:
            link.wait_sends()
        comm_time += time.perf_counter() - t0
        self.step_timings.update(compute=compute_time, p2p=comm_time, step=step_time)
        self._buf = {}
        return self._results

    def _prefetch(self, m: int) -> List[Any]:
        """The batch's m micro-batches, read before any transfer: a data problem then stops
        every stage of the pipeline with the same error instead of leaving some waiting.
        The first stage tells the stages downstream through the activation header they are
        about to receive; the last stage takes that notice before it raises."""
        batches, problem = [], None
        if self.data_iterator is None:
            problem = AbortNotice(AbortNotice.NO_DATA, 0, m)
        else:
            try:
                for _ in range(m):
                    batches.append(self._checked(next(self.data_iterator)))
            except StopIteration:
                problem = AbortNotice(AbortNotice.RAN_OUT, len(batches), m)
        if problem is None:
            return batches
        if self.num_stages > 1 and self.is_first_stage():
            self._links[0].send_abort(problem)
        elif self.num_stages > 1:
            self._links[0].take_abort()
        raise PipelineError(problem.message())

    def _checked(self, batch):
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(f"pipeline: each micro-batch must be a pair (inputs, labels); got "
                                f"{type(batch).__name__}{'' if not hasattr(batch, '__len__') else f' of {len(batch)}'}")
        return batch

    def _is_last(self, chunk: int) -> bool:
        """Whether this chunk is the pipeline's last virtual stage (it computes the loss)."""
        return self.is_last_stage() and chunk == self.chunks - 1

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the layers are checkpointed with a reentrant function (anything but torch's
        default and DeepSpeed's non_reentrant_checkpoint): its first segment then needs inputs
        that require grad, or its parameters get no gradient. Read from the module, which
        set_checkpoint_interval() may have changed since the config was read."""
        m = self.module
        return m.activation_checkpoint_interval > 0 and m.activation_checkpoint_func is not None \
            and m.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint

    def _load(self, cmd) -> None:
        batch = self._batch_data.pop(0)
        if self.is_first_stage():
            x = batch[0]
            x = move_to(tuple(x), self._engine.device) if isinstance(x, (tuple, list)) else move_to(x, self._engine.device)
            if torch.is_grad_enabled() and self._reentrant_activation_checkpointing():
                x = tuple(_grad_leaf(t) for t in x) if isinstance(x, tuple) else _grad_leaf(x)
            self._buf["inputs"][0, cmd.buffer_id] = x
        if self.is_last_stage():
            self._buf["labels"][self.chunks - 1, cmd.buffer_id] = move_to(batch[1], self._engine.device)

    def _forward(self, cmd) -> None:
        key = (cmd.chunk, cmd.buffer_id)
        x = self._buf["inputs"][key]
        chunk = None if self.chunks == 1 else cmd.chunk
        # an autotuning trial counts what one training micro-batch saves for backward
        probe = self._engine._trial.forward() if self._engine._trial is not None and torch.is_grad_enabled() else nullcontext()
        with self._engine._meter.timed("forward"), probe:
            if self._split:
                out, pieces = self.module.forward_split(x, chunk=chunk)
                self._buf["pieces"][key] = pieces
            else:
                out = self.module(x) if chunk is None else self.module(x, chunk=chunk)
        if not self._is_last(cmd.chunk):
            self._buf["outputs"][key] = out
            return
        if self.eval_return_logits:
            self.outputs = out
        if self._compute_loss and self.module.loss_fn is not None:
            if self._split:  # the loss is one more piece: its input gradient starts the backward
                cut, leaves = detach_floating(out)
                loss = self.module.loss_fn(cut, self._buf["labels"][key])
                self._buf["pieces"][key].append(Piece(leaves, [loss.float()] if torch.is_tensor(loss) else []))
            else:
                loss = self.module.loss_fn(out, self._buf["labels"][key])
        else:
            loss = out
        if self._compute_loss and not (torch.is_tensor(loss) and loss.numel() == 1):
            raise PipelineError("pipeline: the loss must be a single-element tensor; give PipelineModule(loss_fn=...) "
                                f"or make the last layer return the loss (got {type(loss).__name__}"
                                f"{'' if not torch.is_tensor(loss) else f' of shape {list(loss.shape)}'})")
        self._buf["loss"][key] = loss
        self._results.append(loss.detach().float().reshape(()) if self._compute_loss else out.detach())
        self._buf["labels"].pop(key, None)

    def _accumulating(self):
        """(is this the batch's last pass accumulating weight gradients, then count it)"""
        boundary = self._grad_passes == self._grad_passes_total - 1
        self._grad_passes += 1
        return boundary

    def _backward(self, cmd) -> None:
        key = (cmd.chunk, cmd.buffer_id)
        boundary = self._accumulating()
        self._boundary_flag = boundary
        with self._engine._meter.timed("backward"):
            self._engine.strategy.before_backward(boundary)
            if self._is_last(cmd.chunk):
                loss = self._buf["loss"].pop(key)
                factor = self._engine.loss_scale() / self.micro_batches
                (loss.float() * factor).backward()
            else:
                outs = floating(self._buf["outputs"][key])
                pairs = [(o, g) for o, g in zip(outs, self._grads) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                self._grads = None
            self._engine.strategy.after_backward(boundary)
        if boundary and self._engine._trial is not None:
            self._engine._trial.after_backward()  # the batch's gradients are held now; the step frees them
        self._boundary_flag = False
        self._buf["outputs"].pop(key, None)

    def _backward_input(self, cmd) -> None:
        """Input gradients only, layer by layer from the last: each piece keeps the gradient
        of its outputs for the BackwardWeight of this micro-batch, and the stage's input
        gets its gradient in .grad (what SendGrad sends). No weight gradient is touched."""
        key = (cmd.chunk, cmd.buffer_id)
        pieces: List[Piece] = self._buf["pieces"][key]
        with self._engine._meter.timed("backward"):
            if self._is_last(cmd.chunk):
                loss = self._buf["loss"].pop(key)
                factor = self._engine.loss_scale() / self.micro_batches
                if self.module.loss_fn is None:  # the last layer's output is the loss
                    pieces[-1].outputs = [loss.float()]
                grads = [torch.full_like(loss.float(), factor)]
            else:
                grads = list(self._grads)
                self._grads = None
            for piece in reversed(pieces):
                piece.grads = grads
                pairs = [(o, g) for o, g in zip(piece.outputs, grads) if o.requires_grad]
                wanted = [t for t in piece.inputs if t.requires_grad]
                got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                               retain_graph=True, allow_unused=True) if pairs and wanted else ())
                grads = []
                for t in piece.inputs:
                    g = next(got, None) if t.requires_grad and pairs else None
                    grads.append(torch.zeros_like(t) if g is None else g)
            for t, g in zip(pieces[0].inputs if pieces else [], grads):
                if t.requires_grad:
                    t.grad = g  # the stage's input: SendGrad sends it upstream
        self._buf["outputs"].pop(key, None)

    def _backward_weight(self, cmd) -> None:
        """The weight gradients of a micro-batch's layers from the output gradients its
        BackwardInput kept, each layer's graph on its own (its input is a leaf), so no
        layer's input gradient is computed twice; accumulated into .grad like a backward."""
        pieces: List[Piece] = self._buf["pieces"].pop((cmd.chunk, cmd.buffer_id))
        boundary = self._accumulating()
        self._boundary_flag = boundary
        params = [p for p in self.module.parameters() if p.requires_grad]
        with self._engine._meter.timed("backward"):
            self._engine.strategy.before_backward(boundary)
            for piece in pieces:
                pairs = [(o, g) for o, g in zip(piece.outputs, piece.grads or []) if o.requires_grad]
                if pairs and params:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=params)
            self._engine.strategy.after_backward(boundary)
        if boundary and self._engine._trial is not None:
            self._engine._trial.after_backward()
        self._boundary_flag = False

    def _send_act(self, cmd) -> None:
        key = (cmd.chunk, cmd.buffer_id)
        self._links[cmd.chunk].send_activation(self._buf["outputs"][key])
        if not torch.is_grad_enabled():
            self._buf["outputs"].pop(key)

    def _recv_act(self, cmd) -> None:
        self._buf["inputs"][cmd.chunk, cmd.buffer_id] = self._links[cmd.chunk].recv_activation()

    def _send_grad(self, cmd) -> None:
        self._links[cmd.chunk].send_grads(self._buf["inputs"].pop((cmd.chunk, cmd.buffer_id)))

    def _recv_grad(self, cmd) -> None:
        self._grads = self._links[cmd.chunk].recv_grads(self._buf["outputs"][cmd.chunk, cmd.buffer_id])

    def _reduce_tied(self, cmd) -> None:
        """Tied weights are summed in _reduce, after the data-parallel reduction: the two
        sums commute, and a ZeRO strategy only has the reduced gradient in partitions."""

    def _reduce(self, cmd) -> None:
        self._engine.strategy.reduce_gradients()
        for weight, group in self.module.get_tied_weights_and_groups():
            self._engine.strategy.sum_param_grads_([weight], group)

    def _optimizer_step(self, cmd) -> None:
        self._engine._boundary_step({}, reduced=True)
        self._engine.micro_steps += self.micro_batches

    # -- losses ----------------------------------------------------------------------------------
    def _mean_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().float().clone()
        if self._engine.dp_world_size > 1:
            comm.all_reduce(value, group=self._engine.dp_group, label="pipeline loss over replicas")
            value /= self._engine.dp_world_size
        return value

    def _aggregate_loss(self, losses: List[torch.Tensor], m: int) -> torch.Tensor:
        """Mean over micro-batches and replicas on the last stage, broadcast along the pipeline."""
        if self.is_last_stage():
            value = self._mean_over_replicas(torch.stack(losses).sum() / m).reshape(1)
        else:
            value = torch.zeros(1, dtype=torch.float32, device=self._engine.device)
        if self.num_stages > 1:
            comm.broadcast(value, src=self._engine.grid.stage_to_global(self.num_stages - 1),
                           group=self._engine.grid.get_pipe_parallel_group(), label="pipeline loss")
        return value[0]


def _grad_leaf(t):
    """A floating input as a leaf that requires grad, for a reentrant checkpoint's first segment."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


def _checked_schedule(name, model: PipelineModule) -> str:
    """The schedule named by pipeline.schedule, if it exists and fits the module's chunks
    (checked on every rank alike, before the engine builds anything)."""
    problem = S.unknown_schedule(name)
    if problem:
        raise ConfigError(f"pipeline.schedule: {problem}")
    chunks = model.virtual_stages
    if name in S.CHUNKED and chunks < 2:
        raise ConfigError(f"pipeline.schedule: {name!r} runs several model chunks per stage; build the "
                          "PipelineModule with virtual_stages=2 or more")
    if name not in S.CHUNKED and chunks > 1:
        raise ConfigError(f"pipeline.schedule: {name!r} runs one model chunk per stage but the PipelineModule has "
                          f"virtual_stages={chunks}; use \"interleaved-1f1b\" or virtual_stages=1")
    return name
