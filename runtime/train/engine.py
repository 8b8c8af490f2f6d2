"""The training engine `initialize` returns: DeepSpeed's DeepSpeedEngine surface.

The engine owns what all ZeRO stages share (config, batch sizes, precision casting, loss
scaling, accumulation counting, clipping arithmetic, LR schedule, logging, checkpoint
files) and delegates gradient reduction, optimizer stepping and parameter sync to the
GradientStrategy chosen by zero_optimization.stage (see strategy.py for the call order).

Where each rank sits comes from `self.mesh` (runtime/core/parallel/): a PipelineModule's mesh,
an `mpu=` object's groups, or a mesh over the world from the config's degrees. Gradients,
shards, the initial weight broadcast and the data sampler use its `data` axis; the
batch-size rule uses the data-parallel size; the gradient norm is summed over its `replica`
axis (every stage and tensor slice of one replica). `self.grid` is the same object, under
the name DeepSpeed's engine gives it.
"""
from __future__ import annotations

import abc
import contextlib
import copy
import os
import dataclasses
import math
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch

from . import checkpoint, model_export
from .checkpoint import dsformat
# DeepSpeed's engine-level name for the parallel degrees a checkpoint records, which its tests import
from .checkpoint.ds_checkpoint import parallel_dimensions_of as _checkpoint_parallel_metadata  # noqa: F401
from .. import zero  # noqa: F401  (registers the ZeRO stages 0-3, the strategies strategy_for_stage picks)
from ..core import comm
from ..core.parallel import current as parallel_current
from ..core.parallel import select as mesh_select
from .compiling import compile_module
from .compression import compression_schedule
from ..core.config import DeepSpeedConfig
from ..core.config.precision import check_param_dtype
from ..core.module_cast import cast_module, keep_in_fp32_pattern, training_dtypes
from .dataloader import ROUTE_TRAIN, DistributedDataLoader, route_loader
from .throughput import ThroughputTimer
from ..core.internals import ROLES_ATTRIBUTE, engine_roles
from ..core.loss_scaler import expose_on_optimizer
from .lr_schedules import build_scheduler
from .optim import OptimizerTarget, build_optimizer
from .optimizer_policy import check_optimizer
from ..core.precision import PrecisionPolicy, cast_floating, explain_dtype_error, forward_context
from .profiling.step import StepProfiler
from .activation_checkpointing import checkpointing
from .autotuning import TrialProbe
from .monitor import StepMeter, build_monitor
from .monitor import report
from .monitor.sink import TRAIN_LOSS
from ..core.muon.sharded import check_in_memory_flag
from ..core.nonfinite import NonFiniteGuard
from .progress import ProgressLog
from .resize import batch as resize_batch
from .resize.contract import ResizeEnv
from ..core.strategy import FragmentError, StrategyContext, strategy_for_stage
from ..zero.hook_scope import apply_leaf_module_config, leaf_parameters
from ..zero.grad_views import publish_grad_partitions
from ..zero.offload_states import offload_strategy_states, reload_strategy_states
from ..core.config.zero import OffloadDeviceEnum
from ..core.errors import CoalesceUnsupportedError, ModelRequiredError, OptimizerRequiredError
from ..core.strict import ConfigError
from .accumulation import check_accumulation_mode, samples_in_step
from .direct_step import route_direct_step
from .tensor_backward import SCALE_REQUIRED, SCALE_REQUIRED_STATIC, BackwardUsageError, OutputGrads, engine_backward


def _needs_scaler_of(engine) -> Callable[[], bool]:
    """DeepSpeed's optimizer.needs_scaler(): whether loss.backward() must be engine.scale(loss).backward().
    DeepSpeed answers True for a dynamic fp16 scale only; here a static scale other than 1 needs it
    too, as the engine refuses an unscaled backward there (_needs_scaled_loss). A weak reference:
    the optimizer must not keep its engine alive."""
    ref = weakref.ref(engine)

    def needs_scaler() -> bool:
        live = ref()
        return live is not None and live._needs_scaled_loss()

    return needs_scaler


def _groups_hold_fp32_partitions() -> None:
    """Nothing to do: the stage-3 optimizer's param groups hold this rank's fp32 partitions."""


def _config_source(args, config, config_params):
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    old_name = getattr(args, "deepscale_config", None) if args is not None else None  # DeepSpeed's deprecated flag
    if old_name is not None:
        if from_args is not None:
            raise ConfigError("config: given both as --deepscale_config and --deepspeed_config; pass one "
                              "(--deepscale_config is the deprecated name)")
        from_args = old_name
    if config is not None and from_args is not None:
        raise ConfigError("config: given both as initialize(config=...) and --deepspeed_config; pass one")
    source = config if config is not None else from_args
    if source is None:
        raise ConfigError("config: none given; pass initialize(config=dict or path) or --deepspeed_config FILE")
    return source


def _raw_config(source) -> dict:
    """A private, editable dict of the config `source` (a dict, a parsed config or a file path),
    for the helpers below that add what initialize() was told outside the config."""
    from ..core.strict import load_file

    if isinstance(source, DeepSpeedConfig):
        source = source.to_dict()
    return copy.deepcopy(source) if isinstance(source, dict) else load_file(str(source))


def _with_mesh_param(source, mesh_param):
    """The config with initialize(mesh_param=(data, sequence))'s sequence size in it: DeepSpeed
    builds its data x sequence mesh from mesh_param, which is the mesh sequence_parallel_size
    builds here. A config that says otherwise is one line; sizes were checked by initialize."""
    if mesh_param is None or mesh_param[1] == 1:
        return source
    data, sequence = mesh_param
    raw = _raw_config(source)
    for key, size in (("sequence_parallel_size", sequence), ("data_parallel_size", data)):
        if raw.get(key, size) != size:
            raise ConfigError(f"config: {key}: {raw[key]} but initialize(mesh_param={tuple(mesh_param)}) gives {size}; "
                              "set one of the two")
    raw["sequence_parallel_size"] = sequence
    return raw


def _with_tp_model_init(source, mpu):
    """The config with what deepspeed.tp_model_init recorded merged in (DeepSpeed 0.19's
    contract: the config's values win, a disagreement is one line), and the tp_group it was
    given, if any (kept out of the config: a process group is no config value)."""
    from .. import tensor_parallel

    if tensor_parallel.recorded_tp_model_init() is None:
        return source, None
    try:
        raw = tensor_parallel.merge_tp_model_init_into_config(_raw_config(source), mpu)
    except tensor_parallel.TensorParallelError as exc:
        raise ConfigError(str(exc)) from None
    group = raw["tensor_parallel"].get("tp", {}).pop("tp_group", None)
    return raw, group


# An ABC only so that an engine built by composition can count as one: the pipeline engine
# holds a DeepSpeedEngine and registers itself (pipe_engine.py), as DeepSpeed's PipelineEngine,
# a subclass there, passes isinstance(engine, DeepSpeedEngine) in scripts and Hugging Face.
class DeepSpeedEngine(torch.nn.Module, metaclass=abc.ABCMeta):
    def __init__(self, args=None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
                 training_data=None, lr_scheduler=None, mpu=None, dist_init_required: Optional[bool] = None,
                 collate_fn=None, config=None, config_class=None, mesh_device=None, dont_change_device: bool = False,
                 config_params=None, mesh_param=None):
        # DeepSpeed's parameter order, so a subclass or a direct call written for it binds alike;
        # config_class is a parsed config (DeepSpeed's DeepSpeedConfig object) and wins over
        # config; dont_change_device leaves the model where the caller put it. mesh_param is
        # initialize's (DeepSpeed passes the mesh it built from it as mesh_device).
        super().__init__()
        if model is None:
            raise ModelRequiredError("initialize: model= is required" + (
                " (a model was passed as the first argument, which is args; pass model=...)"
                if isinstance(args, torch.nn.Module) else ""))
        if mesh_device is not None:
            raise ConfigError("DeepSpeedEngine: mesh_device is not supported; the engine builds its mesh from the "
                              "config and mpu (dslaunch.runtime.parallel)")
        trial_baseline = TrialProbe.baseline(model)  # under `dslaunch --autotuning` only
        source = config_class if config_class is not None else _config_source(args, config, config_params)
        source, self._given_tp_group = _with_tp_model_init(source, mpu)
        source = _with_mesh_param(source, mesh_param)
        self.config = DeepSpeedConfig.load(source)
        check_accumulation_mode(self.config, pipeline=False)
        comm.init_distributed(dist_init_required=dist_init_required)
        section = self.config.comms_logger
        comm.configure(enabled=section.enabled, prof_all=section.prof_all, prof_ops=section.prof_ops,
                       verbose=section.verbose, debug=section.debug, timeout=self.config.comms_timeout)
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.local_rank = comm.local_rank()
        self.mesh = self.grid = self._make_mesh(model, mpu)
        parallel_current.set_current(self.mesh)  # deepspeed.utils.groups answers from it
        self.mpu = mpu if mpu is not None else self.mesh
        self.dp_world_size = self.mesh.size("data")
        if self.config.data_parallel_size not in (None, self.dp_world_size):
            raise ConfigError(f"config: data_parallel_size: {self.config.data_parallel_size} but {self.world_size} "
                              f"ranks laid out as {self.mesh.dims} leave {self.dp_world_size} data-parallel "
                              "ranks; set it to that or remove it")
        self.dp_rank = self.mesh.rank("data")
        self.dp_group = self.mesh.group("data")
        self.mp_world_size = self.mesh.size("replica")
        # where replicated parameters' gradients are averaged and ZeRO state is sharded: the
        # data axis, or data x sequence when sequence ranks split each sample (Ulysses)
        self.seq_parallel_size = self.mesh.size("sequence")
        self.seq_parallel_group = self.mesh.group("sequence")  # DeepSpeed's name: DistributedAttention's group
        grad_axis = mesh_select.gradient_axis(self.mesh)
        self.seq_data_parallel_group = self.mesh.group(grad_axis)
        self._grad_rank, self._grad_world = self.mesh.rank(grad_axis), self.mesh.size(grad_axis)
        # in a resizable job the configured global batch holds at every size (resize/batch.py)
        self._resize_env = ResizeEnv.from_environ()
        self._resize = None  # the ResizeDriver initialize() attaches (resize_driver.py)
        autotp = self.config.tensor_parallel.size
        self.batch = resize_batch.batch_sizes(
            self.config, mesh_select.batch_world_size(self.mesh, mpu, autotp),
            mesh_select.dp_size_source(self.mesh, mpu, comm.world_source(), self.world_size, autotp), self.world_size,
            self._resize_env.base_world)
        self.device = (torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu"))
        if self.config.expert_parallel.enabled:  # AutoEP: this rank's experts take the blocks' place
            from ..moe import autoep

            optimizer, model_parameters = autoep.attach(self._autoep_plan, self.config, model, self.mesh, optimizer,
                                                        model_parameters)
        # every dtype (and fp16's loss scaler) from one place: the strategies ask it, the engine has no branches
        self.precision = PrecisionPolicy.from_config(self.config)
        self.compute_dtype = self.precision.compute
        if self.config.tensor_parallel.size > 1:  # AutoTP; a model with its own mesh may be split already
            optimizer, model_parameters = self._apply_tensor_parallel(model, optimizer, model_parameters)

        if not dont_change_device:
            model.to(self.device)
        # parameters to fp16/bf16; buffers keep their dtype unless data_types says (core/module_cast.py)
        param_dtype, buffer_dtype = training_dtypes(self.fp16_enabled(), self.bfloat16_enabled(),
                                                    self.config.buffer_dtype)
        if param_dtype is not None:
            cast_module(model, param_dtype, buffer_dtype,
                        keep=keep_in_fp32_pattern(model, self.config.keep_in_fp32_modules, param_dtype))
        self._broadcast_initial_state(model)
        self.module = model
        self._compression = self._compression_schedule(model)

        if optimizer is None and self.config.optimizer is not None and self.config.optimizer.type.lower() == "muon":
            from ..core.muon.tagging import tag_parameters

            tag_parameters(model)  # as DeepSpeed's initialize: which parameters Muon steps, by shape and name
        self.optimizer = self._make_optimizer(optimizer, model_parameters, model)
        if self.optimizer is not None:
            check_optimizer(self.optimizer, self.config, client=optimizer is not None)
            # DeepSpeed's optimizers say whether the last step was skipped (fp16 overflow);
            # Accelerate reads it so that a scheduler it steps skips that step too.
            self.optimizer.overflow = False
            # DeepSpeed's engine.optimizer under ZeRO or fp16 is a wrapper whose .optimizer is the
            # optimizer that steps (scripts reach the base optimizer through it); dslaunch does not
            # wrap, so the optimizer that steps is its own .optimizer (unless it has one already).
            if not hasattr(self.optimizer, "optimizer"):
                self.optimizer.optimizer = self.optimizer
            if self.config.zero_optimization.stage == 3:
                # DeepSpeed's stage-3 optimizer empties its inner param groups between steps, and
                # scripts bracket a state_dict() of it with these two calls to put this rank's fp32
                # partitions back and take them out again; here the groups hold them all along
                for name in ("_set_fp32_optimizer_param_groups", "_clear_fp32_optimizer_param_groups"):
                    if not hasattr(self.optimizer, name):
                        setattr(self.optimizer, name, _groups_hold_fp32_partitions)
            # isinstance(engine.optimizer, ZeROOptimizer / DeepSpeedOptimizer) as DeepSpeed's wrapper
            # would answer, and its needs_scaler() (PyTorch-style backward scripts ask it)
            setattr(self.optimizer, ROLES_ATTRIBUTE, engine_roles(self.config.zero_optimization.stage,
                                                                  self.compute_dtype, pipeline=False))
            # (an optimizer class's own needs_scaler stays; one an earlier engine set answers for
            # that engine, so it is replaced)
            if not hasattr(type(self.optimizer), "needs_scaler"):
                self.optimizer.needs_scaler = _needs_scaler_of(self)
        check_in_memory_flag(self.config, self.optimizer)
        if self.seq_parallel_size > 1 and self.optimizer is not None and any(
                g.get("moe", False) for g in self.optimizer.param_groups):
            raise ConfigError(f"sequence_parallel_size {self.seq_parallel_size} with \"moe\" param groups (expert "
                              "parallelism) is not supported")
        # zero_optimization.leaf_module (by default transformers' MoE blocks), marked at every
        # stage as DeepSpeed's engine does; only stage 3's hooks read the marks
        apply_leaf_module_config(model, self.config.zero_optimization.leaf_module)
        ctx = StrategyContext(module=model, optimizer=self.optimizer, config=self.config, device=self.device,
                              compute_dtype=self.compute_dtype, rank=self._grad_rank, world_size=self._grad_world,
                              group=self.seq_data_parallel_group, norm_exclude=mesh_select.norm_exclude(model, self.mesh, mpu),
                              mesh=self.mesh, loss_scale=self.loss_scale, precision=self.precision)
        self.strategy = strategy_for_stage(self.config.zero_optimization.stage)(ctx)
        self.strategy.wrap_module()
        if self.config.zero_optimization.stage == 3 and self.optimizer is not None:
            # DeepSpeed's stage-3 optimizer lists each leaf module's trained parameters (scripts and
            # its tests read it); here the leaf marks drive stage 3's hooks, and this is their account.
            # The optimizer's groups hold fp32 partitions at stage 3, so the model's order stands in
            # for theirs (DeepSpeed's groups follow model_parameters, the model's order as a rule).
            self.optimizer.leaf_parameters = leaf_parameters(model, model.parameters())
            publish_grad_partitions(self.optimizer, self.strategy)
        self.loss_scaler = self.precision.loss_scaler
        if self.loss_scaler is not None and self.optimizer is not None:
            expose_on_optimizer(self.optimizer, self.loss_scaler)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        # a script's engine.optimizer.step() takes the engine's step (direct_step.py); the
        # engine's own optimizer step passes through the route
        self._direct_step = route_direct_step(self, self._script_optimizer_step)

        self.collate_fn = collate_fn
        self.training_dataloader = None
        if training_data is not None:
            # through the method, as DeepSpeed does: a script (or test) that wraps it sees this call
            self.training_dataloader = self.deepspeed_io(training_data)

        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._last_grad_norm: Optional[float] = None
        self._step_norm: Optional[float] = None  # this step's global gradient norm, when it was taken
        # fp32/bf16 non-finite steps (fp16 has its loss scaler): skipped, reported, stop after N in a row
        self._nonfinite = NonFiniteGuard(self.config.nonfinite_check.max_consecutive_steps) \
            if self.config.nonfinite_guard and self.loss_scaler is None else None
        self._step_applied = False
        self._train_steps: Optional[int] = None
        self._boundary_override: Optional[bool] = None  # set_gradient_accumulation_boundary (Accelerate)
        # managed_gradient_accumulation false (accumulation.py): step() is the boundary, and counts
        # the backwards since the last one for global_samples
        self._managed = self.config.managed_gradient_accumulation
        self._in_step = False
        self._backwards_since_step = 0
        # PyTorch-style backward (tensor_backward.py): forward() returns its outputs as aliases whose
        # gradients run this engine's backward prologue and epilogue
        self._own_backward = 0  # this engine's engine.backward() calls in progress
        self._scale_called = False  # engine.scale(loss) since the last backward the script started itself
        self._no_sync = False  # inside no_sync() or coalesce_grad_reduction(): backward reduces nothing
        self.pipeline_parallelism = False  # DeepSpeed's flag; the pipeline engine is PipelineEngine
        self._prologue_open = False  # a backward's prologue ran and its epilogue has not yet
        self._output_grads = OutputGrads(self._tensor_backward_started, self.gradient_accumulation_steps,
                                         lambda: self._own_backward > 0)
        self._setup_reporting()
        # under `dslaunch --autotuning`: measure this trial's profile steps, then stop it cleanly
        self._trial = TrialProbe.from_env(self, trial_baseline, checkpointing)
        # DeepSpeed leaves this to the script (configure()); without it the section would do nothing.
        checkpointing.configure_from_engine(getattr(self, "mpu", None), self.config)
        self._compiled_with: Optional[Dict[str, Any]] = None
        if self.config.compile.enabled:
            self.compile()

    def __getattr__(self, name: str):
        """The model's attributes through the engine (`engine.moe_1`, `engine.config` of a
        Hugging Face model when the engine has none), as DeepSpeed's engine passes them; the
        engine's own attributes come first."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def _apply_tensor_parallel(self, model, optimizer, model_parameters):
        """AutoTP training: shard the model's layers over the mesh's tensor axis (unless the
        script already did, with tp_model_init), and point a client optimizer or parameter
        list at the sharded parameters that replace the full ones."""
        from .. import tensor_parallel

        tp = self.config.tensor_parallel
        if self.config.zero_optimization.stage == 3:
            raise ConfigError(f"tensor_parallel.autotp_size {tp.size} with zero_optimization.stage 3 is not "
                              "supported; use ZeRO stage 0, 1 or 2 with tensor parallelism")
        if tp.dtype is not None:
            from ..core.config.precision import dtype_named

            want = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
            given = dtype_named("tensor_parallel.dtype", tp.dtype)
            engine_dtype = self.precision.compute
            if given != engine_dtype:
                raise ConfigError(f"tensor_parallel.dtype: {tp.dtype} differs from the engine's precision "
                                  f"({want[engine_dtype]}, from the fp16/bf16 sections)")
        group, size, rank = self.mesh.group("tensor"), self.mesh.size("tensor"), self.mesh.rank("tensor")
        if self._given_tp_group is not None:
            given = comm.get_all_ranks_from_group(self._given_tp_group)
            if list(given) != self.mesh.ranks("tensor"):
                raise ConfigError(f"tp_model_init(tp_group=...): its ranks {list(given)} are not this rank's tensor "
                                  f"group in DeepSpeed's layout {self.mesh.ranks('tensor')} (tensor ranks adjacent)")
        names = {id(p): n for n, p in model.named_parameters()}
        try:
            # every tensor rank slices the same full weights (tensor rank 0's, broadcast first);
            # what cannot be split is one line before anything is sent or changed
            tensor_parallel.shard_model_for_training(model, group, size, rank, tp.partition_config)
        except tensor_parallel.TensorParallelError as exc:
            raise ConfigError(str(exc)) from None
        tensor_parallel.use_group(group, size)  # model_parallel_cuda_manual_seed and tp_model_init find it
        after = dict(model.named_parameters())

        def remap(params):
            out = []
            for p in params:
                name = names.get(id(p))
                out.append(after.get(name, p) if name is not None else p)
            return out

        if isinstance(optimizer, torch.optim.Optimizer):
            for g in optimizer.param_groups:
                g["params"] = remap(g["params"])
            if any(len(v) for v in optimizer.state.values()):
                raise ConfigError("initialize(optimizer=...): the optimizer already holds state; with tensor "
                                  "parallelism create it before any step (its parameters are replaced by shards)")
            optimizer.state.clear()
        if model_parameters is not None:
            items = list(model_parameters)
            if items and isinstance(items[0], dict):
                model_parameters = [dict(g, params=remap(g["params"])) for g in items]
            else:
                model_parameters = remap(items)
        return optimizer, model_parameters

    def _make_mesh(self, model, mpu):
        from ..moe.utils import expert_parallel_size, moe_layers, refuse_native_moe_at_stage3

        refuse_native_moe_at_stage3(model, self.config.zero_optimization.stage)
        try:
            expert = expert_parallel_size(model)
            if self.config.expert_parallel.enabled:  # AutoEP: checked now, the blocks swapped once the mesh exists
                from ..moe import autoep

                native = bool(moe_layers(model))
                self._autoep_plan = autoep.plan(self.config, model, mpu, self.world_size, native)
                expert = self._autoep_plan.ep_size
            mesh = mesh_select.mesh_for(model, mpu, self.global_rank, self.world_size, comm.is_initialized(),
                                        tensor=self.config.tensor_parallel.size, expert=expert,
                                        sequence=self.config.sequence_parallel_size)
        except mesh_select.MeshError as exc:
            raise ConfigError(str(exc)) from None
        self.expert_parallel_size = expert
        if expert > 1:
            for layer in moe_layers(model):
                layer.set_expert_group(mesh.group("expert"))
        return mesh

    def _setup_reporting(self) -> None:
        # Rank 0 reports through one Monitor: the progress line plus the configured monitors.
        c, rank0 = self.config, self.global_rank == 0
        breakdown = c.wall_clock_breakdown or c.flops_profiler.enabled
        self.progress = ProgressLog(c.steps_per_print, enabled=rank0 and not c.quiet, wall_clock_breakdown=breakdown,
                                    throughput=c.timers.throughput.enabled)
        self.monitor = build_monitor(c, self.global_rank, self.progress)
        self._meter = StepMeter(breakdown, synchronize=c.timers.throughput.synchronized or breakdown)
        # DeepSpeed's engine.tput_timer: started at each forward, stopped at each step()
        self.tput_timer = ThroughputTimer(c.timers.throughput, batch_size=self.train_batch_size())
        self._flops = StepProfiler(c.flops_profiler, self.module, self.global_rank)
        self._gc = report.PythonGC()
        if c.disable_python_gc:
            self._gc.acquire()
        if rank0:
            for line in filter(None, [None if c.quiet else report.startup_line(self),
                                      report.vocabulary_warning(c.vocabulary_size)]):
                print(line, flush=True)
            if c.dump_state:
                report.dump_state(self)

    def _memory(self, label: str) -> None:
        if self.config.memory_breakdown and self.global_rank == 0:
            print(report.memory_line(label, self.device), flush=True)

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[Dict[str, Any]] = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the module in place (defaults from the config's `compile` section); a second
        call is a no-op."""
        if self._compiled_with is not None:
            return
        self._compiled_with = compile_module(self.module, self.config.compile, backend, compile_kwargs, schedule,
                                             compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        return self._compiled_with is not None

    def set_train_steps(self, steps: int) -> None:
        """The run's total optimizer steps, for the progress line's step/total and ETA."""
        self._train_steps = int(steps)

    # -- set-up helpers ----------------------------------------------------------------------
    def _broadcast_initial_state(self, model: torch.nn.Module) -> None:
        # Replicas may have initialised differently (different seeds): the first rank of
        # each data-parallel group wins (other stages and tensor slices hold other weights;
        # sequence ranks hold the same ones, so the group is data x sequence then). Experts
        # differ across the expert axis: each is broadcast over its replicas (expert_data)
        # from the first of them, as DeepSpeed does.
        if self._grad_world > 1 and comm.is_initialized():
            from ..moe.utils import is_moe_param

            src = self.mesh.ranks(mesh_select.gradient_axis(self.mesh))[0]
            with torch.no_grad():
                for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                    if is_moe_param(t) and self.expert_parallel_size > 1:
                        if self.mesh.size("expert_data") > 1:
                            comm.broadcast(t.data, src=self.mesh.ranks("expert_data")[0],
                                           group=self.mesh.group("expert_data"), label=f"initial expert {name}")
                        continue
                    comm.broadcast(t.data, src=src, group=self.seq_data_parallel_group, label=f"initial {name}")

    def _make_optimizer(self, optimizer, model_parameters, model):
        if optimizer is not None and self.config.optimizer is not None:
            raise ConfigError("optimizer: given both as initialize(optimizer=...) and in the config; pass one")
        params = model_parameters if model_parameters is not None else model.parameters()
        from ..moe import utils as moe_utils

        stage = self.config.zero_optimization.stage
        if isinstance(optimizer, torch.optim.Optimizer):
            return moe_utils.check_moe_param_groups(optimizer, model, stage)
        if callable(optimizer):
            return moe_utils.check_moe_param_groups(optimizer(params), model, stage)
        if self.config.optimizer is None:
            if stage in (0, 3):
                # forward only, as DeepSpeed allows: ZeRO inference with the model sharded (the HF
                # Trainer's evaluate/predict), or a plain engine; backward and step are refused
                return None
            raise OptimizerRequiredError(f"optimizer: none given, and ZeRO stage {stage} requires an optimizer; add "
                                         f"an \"optimizer\" section to the config or pass optimizer=")
        if moe_utils.expert_layers(model):  # as DeepSpeed: expert parameters get "moe" param groups of their own
            params = moe_utils.configure_moe_param_groups(list(params))
        return moe_utils.check_moe_param_groups(
            build_optimizer(self.config.optimizer, params,
                            OptimizerTarget.of(self.config, self.device, self.precision)), model, stage)

    def _make_scheduler(self, lr_scheduler):
        if self.optimizer is None:  # forward only: nothing to schedule (DeepSpeed builds none either)
            return None
        if lr_scheduler is not None and self.config.scheduler is not None:
            raise ConfigError("scheduler: given both as initialize(lr_scheduler=...) and in the config; pass one")
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
                else lr_scheduler
        if self.config.scheduler is not None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        return None

    # -- DeepSpeed's accessors ---------------------------------------------------------------
    def deepspeed_io(self, dataset, batch_size=None, route=ROUTE_TRAIN, pin_memory=True, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None, *, shuffle=None):
        """DeepSpeed's: a loader giving this data-parallel rank its share of `dataset`, with the
        micro batch size and initialize's collate_fn unless given (dataloader.route_loader)."""
        return route_loader(dataset, self.train_micro_batch_size_per_gpu() if batch_size is None else batch_size,
                            self.dp_rank, self.dp_world_size, route=route, pin_memory=pin_memory,
                            data_sampler=data_sampler, collate_fn=self.collate_fn if collate_fn is None else collate_fn,
                            num_local_io_workers=num_local_io_workers, drop_last=self.config.dataloader_drop_last,
                            shuffle=shuffle)

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch from more or fewer micro-batches per step (the
        micro-batch size stays); it must be a multiple of micro-batch x data-parallel ranks."""
        b = self.batch
        ranks = b.train_batch_size // (b.micro_batch_per_gpu * b.gradient_accumulation_steps)
        per_micro = b.micro_batch_per_gpu * ranks
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size <= 0 \
                or train_batch_size % per_micro:
            raise ValueError(f"Train batch size must be divisible by micro-batch data parallelism: "
                             f"set_train_batch_size({train_batch_size!r}) needs a positive multiple of "
                             f"{b.micro_batch_per_gpu} (micro-batch) x {ranks} (data-parallel ranks) = {per_micro}")
        self.batch = dataclasses.replace(b, train_batch_size=train_batch_size,
                                         gradient_accumulation_steps=train_batch_size // per_micro)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size with the same accumulation steps, so the global
        batch changes with it (a data loader already built keeps its own batch size)."""
        b = self.batch
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): the micro-batch size must be a "
                             "positive integer")
        ranks = b.train_batch_size // (b.micro_batch_per_gpu * b.gradient_accumulation_steps)
        self.batch = dataclasses.replace(b, micro_batch_per_gpu=micro_batch_size,
                                         train_batch_size=micro_batch_size * b.gradient_accumulation_steps * ranks)

    def tput_log(self, *msg) -> None:
        """DeepSpeed's: print on rank 0 at the steps_per_print cadence."""
        every = self.config.steps_per_print
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            print(*msg, flush=True)

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def _config(self) -> DeepSpeedConfig:
        """DeepSpeed's name for the engine's parsed config."""
        return self.config

    # DeepSpeed's private helpers of its fp16/bf16 cast, under its names (its tests call them
    # with a stand-in engine); initialize does the same through core/module_cast.py
    def _assert_valid_mixed_precision_config(self) -> None:
        check_param_dtype(self._config.param_dtype, self.fp16_enabled(), self.bfloat16_enabled())

    def _mixed_precision_dtypes(self):
        return training_dtypes(self.fp16_enabled(), self.bfloat16_enabled(), self._config.buffer_dtype)

    def _cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None) -> None:
        cast_module(self.module, param_dtype, buffer_dtype, cast_params=not is_zero_init_model, keep=keep_pattern)

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def allreduce_gradients(self, bucket_size: Optional[int] = None) -> None:
        """DeepSpeed's call to finish the boundary's gradient reduction now, after backward:
        the averaged gradients are then where the step reads them (stages 0-2 reduce once, so
        a further backward must wait for the step; stage 3's backwards reduce as they go).
        bucket_size, DeepSpeed's fallback bucket, changes no value: zero_optimization's
        bucket sizes cut the reductions here."""
        self._require_optimizer("allreduce_gradients")
        self.strategy.complete_reductions("allreduce_gradients")

    def get_global_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped for an fp16 overflow."""
        return self._step_applied

    def managed_gradient_accumulation(self) -> bool:
        """False when the script owns the boundary: every step() reduces and updates."""
        return self._managed

    def is_gradient_accumulation_boundary(self) -> bool:
        if not self._managed:
            return self._in_step  # the script's step() is the boundary, and nothing else
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    @property
    def _is_gradient_accumulation_boundary(self) -> Optional[bool]:
        """DeepSpeed's name for what set_gradient_accumulation_boundary() said last (None: not
        called, the micro-step count decides); its tests and some scripts read it."""
        return self._boundary_override

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the next backward/step ends an accumulation window (Accelerate and the HF
        Trainer call this before every backward and step only at the boundary); overrides the
        micro-step count from then on."""
        if not self._managed:
            raise BackwardUsageError("set_gradient_accumulation_boundary() is not supported with "
                                     "managed_gradient_accumulation=False: the script owns the boundary by calling "
                                     "step()")
        self._boundary_override = bool(is_boundary)

    # -- training ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._resize is not None:
            self._resize.check_stop()
        if self.config.fp16.auto_cast and self.compute_dtype == torch.float16:
            args, kwargs = cast_floating(args, torch.float16), cast_floating(kwargs, torch.float16)
        self.tput_timer.start()
        try:
            with self._meter.timed("forward"), self._flops.forward(self.global_steps), \
                    forward_context(self.precision, self.device), \
                    (self._trial.forward() if self._trial is not None else contextlib.nullcontext()):
                out = self.module(*args, **kwargs)
        except RuntimeError as exc:
            explain_dtype_error(exc, self.compute_dtype, args, kwargs)
            raise
        self._memory("after forward")
        if torch.is_grad_enabled():
            out = self._output_grads.wrap(out)  # so that out.backward() / loss.backward() train as engine.backward
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """scale_wrt_gas=False: the caller already divided the loss by the accumulation steps
        (the HF Trainer does)."""
        boundary = self._backward_prologue()
        self._meter.add_loss(loss.detach().float())  # read at the boundary: no sync per micro-step
        factor = self.loss_scale() / (self.batch.gradient_accumulation_steps if scale_wrt_gas else 1)
        scaled = loss.float() * factor if factor != 1.0 else loss
        with self._meter.timed("backward"):
            with self._meter.timed("backward_inner"), engine_backward():
                self._own_backward += 1
                try:
                    scaled.backward(retain_graph=retain_graph)
                finally:
                    self._own_backward -= 1
            with self._meter.timed("backward_allreduce"):
                self._backward_epilogue(boundary)
        return loss

    def _backward_prologue(self) -> bool:
        """What every backward through this engine starts with, engine.backward() or one the
        script starts itself (loss.backward(), out.backward(grad)): the strategy learns whether
        this micro-step ends the accumulation window. Returns whether it does."""
        self._require_optimizer("backward")
        if self.strategy.grads_reduced_early:
            raise FragmentError("engine.backward(): this step's gradients were already reduced for "
                                "safe_get_full_grad / safe_set_full_grad; call engine.step() before the next backward")
        boundary = self.is_gradient_accumulation_boundary()
        self._backwards_since_step += 1
        self._prologue_open = True
        self.strategy.before_backward(boundary and not self._no_sync)
        return boundary

    def _backward_epilogue(self, boundary: Optional[bool] = None) -> None:
        """Once every gradient of the backward pass is computed: the strategy reduces what the
        micro-step calls for (nothing inside no_sync), and at the boundary the gradients are
        readable until step().

        With no argument it is DeepSpeed's call for a script that ran backward on the outputs
        of `engine.module(...)` itself (one loss over several engines), so no prologue ran."""
        if boundary is None and not self._prologue_open:
            boundary = self._unprologued_backward()
        self._prologue_open = False
        reduce = boundary and not self._no_sync
        self.strategy.after_backward(reduce)
        if reduce:
            self.strategy.open_grad_window()  # safe_get_full_grad reads them until step()
            if self._trial is not None:
                self._trial.after_backward()  # the gradients are held now; the step frees them
        self._memory("after backward")

    def _unprologued_backward(self) -> bool:
        """The boundary of a backward that ran past the engine's forward, where the strategy's
        hooks already did their part without being told the micro-step: stage 3 reduces every
        gradient regardless, stage 2 every micro-step, stage 1 with one micro-step per step only
        reduces at boundaries, which every micro-step is. Stage 0 is refused, as DeepSpeed does."""
        self._require_optimizer("_backward_epilogue")
        stage = self.config.zero_optimization.stage
        if stage == 0 or (stage == 1 and (self.batch.gradient_accumulation_steps > 1 or not self._managed)):
            raise BackwardUsageError(
                f"_backward_epilogue() after a backward that did not go through the engine's forward is not supported "
                f"at ZeRO stage {stage}"
                + (" with gradient_accumulation_steps > 1 or unmanaged accumulation" if stage == 1 else "") +
                ": call outputs = engine(...) so that loss.backward() runs the engine's prologue, or use "
                "engine.backward(loss)")
        boundary = self.is_gradient_accumulation_boundary()
        self._backwards_since_step += 1
        return boundary

    def _tensor_backward_started(self):
        """The first gradient of a backward pass the script started itself reached this engine's
        outputs: run the prologue, and return the epilogue to run once the pass is done."""
        if self._needs_scaled_loss() and not self._scale_called:
            raise RuntimeError(SCALE_REQUIRED if self.loss_scaler.dynamic else SCALE_REQUIRED_STATIC)
        boundary = self._backward_prologue()
        self._scale_called = False
        self._meter.begin("backward")

        def epilogue():
            with self._meter.timed("backward_allreduce"):
                self._backward_epilogue(boundary)
            self._meter.end("backward")

        return epilogue

    def _needs_scaled_loss(self) -> bool:
        # fp16 with a loss scale other than 1: gradients from an unscaled loss would be divided by
        # the scale at the step. DeepSpeed 0.19.8 asks for engine.scale only under a dynamic scale
        # and trains a static one silently wrong; both are refused here.
        return self.loss_scaler is not None and (self.loss_scaler.dynamic or self.loss_scaler.scale != 1.0)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the fp16 loss scale, for `engine.scale(loss).backward()` in place
        of engine.backward(loss) (the division by the accumulation steps happens at the outputs)."""
        if self.optimizer is None:
            raise BackwardUsageError("engine.scale(loss): this engine has no optimizer (no \"optimizer\" section, no "
                                     "initialize(optimizer=)), so it cannot train")
        if not (torch.is_tensor(loss) and loss.numel() == 1 and loss.grad_fn is not None):
            raise BackwardUsageError("engine.scale(loss): loss must be a scalar tensor with grad_fn (a loss computed "
                                     "from the engine's outputs); for a non-scalar tensor call tensor.backward(grad)")
        self._scale_called = True
        scale = self.loss_scale()
        return loss * scale if scale != 1.0 else loss

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside the block reduces nothing: gradients accumulate on each rank, and the
        next backward outside it (or the step) reduces them all. ZeRO stages 0 and 1 only."""
        stage = self.config.zero_optimization.stage
        if stage >= 2:
            raise BackwardUsageError(f"no_sync context manager is incompatible with gradient partitioning logic of "
                                     f"ZeRO stage {stage}: every backward reduces each gradient to the rank that "
                                     "owns it; use ZeRO stage 0 or 1 to accumulate without reducing")
        if self._no_sync:
            raise BackwardUsageError("no_sync context manager reentry is unsupported: this engine is already inside "
                                     "no_sync()")
        self._no_sync = True
        self.strategy.local_grads_readable = True
        try:
            yield
        finally:
            self._no_sync = False
            self.strategy.local_grads_readable = False

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed 0.19's one reduction for many backwards, at ZeRO stages 1-3: every backward
        inside the block keeps its gradients on this rank (summed into param.grad, or at stage 3
        a full-size buffer per parameter), and leaving the block reduces them all in one pass,
        so one with-block is one optimizer step's worth of gradients. step() inside the block
        is refused, and so is nesting with no_sync(). If the block raises, this rank reduces
        nothing on the way out: the gradients wait for the next reduction (the next backward's
        or the step's). When every rank raises alike that keeps the ranks in step; a rank that
        raised alone leaves the others waiting in their reduction, as any lone failure does."""
        if not self._managed:
            raise BackwardUsageError("coalesce_grad_reduction is not supported with managed_gradient_accumulation="
                                     "False: the script already owns the accumulation boundary via step()")
        stage = self.config.zero_optimization.stage
        if stage not in (1, 2, 3):
            raise CoalesceUnsupportedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}: "
                                           "at stage 0 use engine.no_sync() to accumulate without reducing")
        if self.pipeline_parallelism:
            raise CoalesceUnsupportedError("coalesce_grad_reduction is not supported under pipeline parallelism: "
                                           "train_batch() reduces once per batch already")
        if self._no_sync:
            raise BackwardUsageError("coalesce_grad_reduction cannot be nested inside another no_sync context")
        self._require_optimizer("coalesce_grad_reduction")
        backwards = self._backwards_since_step
        self.strategy.hold_reductions()
        self._no_sync = True
        ok = False
        try:
            yield
            ok = True
        finally:
            self._no_sync = False
            reduce = ok and self._backwards_since_step != backwards
            self.strategy.release_held_reductions(reduce)
        if reduce and self.is_gradient_accumulation_boundary():
            self.strategy.open_grad_window()  # safe_get_full_grad reads them until step()

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise OptimizerRequiredError(f"optimizer: none given (no \"optimizer\" section, no initialize(optimizer=)), "
                                         f"so this engine runs forward only; {what}() needs one")

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        self._require_optimizer("step")
        if self._no_sync:
            raise BackwardUsageError("It is illegal to call Engine.step() inside no_sync context manager: leave the "
                                     "block first (the step needs the reduced gradients)")
        self._step_applied = False  # as DeepSpeed: a step() that is no boundary applies nothing
        self._in_step = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            with self._meter.timed("step"):
                if boundary:
                    self._boundary_step(lr_kwargs or {})
                self.micro_steps += 1
        finally:
            self._in_step = False
        self.tput_timer.stop(global_step=boundary)
        if boundary:
            self._report_step()
            if self._resize is not None:
                self._resize.after_step()
        self._memory("after step")

    def _report_step(self) -> None:
        lr = self.get_lr()[0] if self.optimizer.param_groups else 0.0
        loader = self.training_dataloader
        epoch_steps = len(loader) // self.batch.gradient_accumulation_steps if loader is not None else None
        record = self._meter.record(self.global_steps, self.global_samples, lr,
                                    self.loss_scaler.scale if self.loss_scaler is not None else None,
                                    self.skipped_steps, total_steps=self._train_steps, epoch_steps=epoch_steps or None)
        if self._nonfinite is not None:
            record.alert = self._nonfinite.observe(self.global_steps, self._step_norm, record.values.get(TRAIN_LOSS))
        self.monitor.write_step(record)
        self._flops.step_done(self.global_steps - 1, record, self.batch.micro_batch_per_gpu
                              * self.batch.gradient_accumulation_steps, report.parallel_sizes(self))
        if self._nonfinite is not None:
            self._nonfinite.check(self.global_steps)  # the same decision on every rank: the norm is global
        if self._trial is not None:
            self._trial.step_done()  # raises TrialComplete after end_profile_step

    def _script_optimizer_step(self) -> None:
        """engine.optimizer.step() called by the script where the strategy owns the step
        (direct_step.py): DeepSpeed's ZeRO optimizer's step (reduce, clip, step, free the
        gradients, update the loss scale), without the LR scheduler and the step counters
        that engine.step() also moves."""
        if self._no_sync:
            raise BackwardUsageError("engine.optimizer.step() inside no_sync: leave the block first (the step needs "
                                     "the reduced gradients)")
        if not self.strategy.grad_window_open:
            raise BackwardUsageError("engine.optimizer.step(): no gradients to step with; call it after "
                                     "engine.backward() on the gradient-accumulation boundary, or call engine.step()")
        self._boundary_step({}, scheduled=False)

    def _boundary_step(self, lr_kwargs: Dict[str, Any], reduced: bool = False, scheduled: bool = True) -> None:
        """Reduce (unless the caller already did), clip, step, zero; count the step and move
        the LR scheduler (unless not `scheduled`: the script's engine.optimizer.step())."""
        s = self.strategy
        with self._meter.timed("backward_allreduce"):
            if not reduced:
                s.reduce_gradients_once()
        clip = self.config.gradient_clipping
        scale = self.loss_scale()
        overflow = False
        coef = 1.0 / scale
        self._step_norm = None
        if self._needs_grad_norm():
            norm = self._step_norm = self._global_grad_norm()
            # nan or inf: skipped, or applied as DeepSpeed applies it where nothing asks to skip
            overflow = not math.isfinite(norm) and self.config.skips_nonfinite_steps()
            true_norm = norm / scale
            self._last_grad_norm = true_norm
            self.optimizer._global_grad_norm = true_norm  # DeepSpeed's ZeRO optimizers keep it there
            if not overflow and clip > 0 and true_norm > clip:
                coef *= clip / (true_norm + 1e-6)
        self._step_applied = not overflow
        self.optimizer.overflow = overflow
        if overflow:
            if scheduled:
                self.skipped_steps += 1
        else:
            if coef != 1.0:
                s.scale_gradients_(coef)
            with self._direct_step.passing_through():  # the optimizer's own step, past the route
                s.optimizer_step()
            if self.lr_scheduler is not None and scheduled:
                self.lr_scheduler.step(**lr_kwargs)
        s.zero_grad()
        s.close_grad_window()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if not scheduled:
            return
        self.global_steps += 1
        self.global_samples += samples_in_step(self.batch.train_batch_size, self.batch.gradient_accumulation_steps,
                                               self._managed, self._backwards_since_step)
        self._backwards_since_step = 0
        self._update_compression()

    def _compression_schedule(self, model):
        """The schedule init_compression left on the model, checked against this config."""
        schedule = compression_schedule(model)
        wanted = self.config.compression_training
        if schedule is None:
            if wanted.enabled:
                raise ConfigError("compression_training: call deepspeed.compression.compress.init_compression(model, "
                                  "config) before deepspeed.initialize")
            return None
        if schedule.config != wanted:
            raise ConfigError("compression_training: differs from the config the model's init_compression used; "
                              "pass the same config to both")
        schedule.update(0)
        return schedule

    def _update_compression(self) -> None:
        """Techniques start and prune on the count of applied optimizer steps (DeepSpeed's
        compression scheduler is stepped after each step without overflow)."""
        if self._compression is not None:
            self._compression.update(self.global_steps - self.skipped_steps)

    def _needs_grad_norm(self) -> bool:
        # fp16 overflow, clipping, bf16's check_grad_overflow, stage 1-2's compute_grad_norm and the
        # non-finite check all need it.
        c = self.config
        return (self.loss_scaler is not None or c.gradient_clipping > 0
                or (c.bf16.enabled and c.bf16.check_grad_overflow)
                or (c.zero_optimization.stage in (1, 2) and c.zero_optimization.compute_grad_norm)
                or self._nonfinite is not None)

    def _global_grad_norm(self) -> float:
        """The strategy's norm (this replica's share, complete over the data-parallel
        group) summed over the model-parallel group: every stage and tensor slice."""
        norm = self.strategy.global_grad_norm()
        axis = mesh_select.norm_axis(self.mesh)
        if axis is not None and comm.is_initialized():
            sq = torch.tensor([norm * norm], dtype=torch.float64, device=self.device)  # NCCL moves no CPU tensors
            comm.all_reduce(sq, group=self.mesh.group(axis), label=f"grad norm over {axis}")
            norm = float(sq.sqrt())
        return norm

    def zero_grad(self) -> None:
        if self.zero_optimization_stage() >= 2:
            # DeepSpeed 0.19.8's engine.zero_grad sets each parameter's .grad to None and nothing
            # more: at ZeRO 2-3 what earlier backwards of the window reduced into the gradient
            # partitions stays and the next step uses it (its ZeRO 0-1 lose it, as we do there).
            # The step clears the partitions itself.
            for p in self.module.parameters():
                p.grad = None
            return
        self.strategy.zero_grad()
        self.strategy.close_grad_window()

    # A ConfigError, the one-line usage error (PipelineError is one too): the engine imports
    # nothing of the pipeline; pipe_engine.py builds on the engine, not the other way round.
    def train_batch(self, data_iter=None):
        raise ConfigError("train_batch: this engine is not a pipeline (the model is not a deepspeed.pipe."
                          "PipelineModule); train with engine(batch), engine.backward(loss), engine.step()")

    def eval_batch(self, data_iter=None, *args, **kwargs):
        raise ConfigError("eval_batch: this engine is not a pipeline (the model is not a deepspeed.pipe."
                          "PipelineModule); evaluate with engine(batch) under torch.no_grad()")

    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    # -- checkpoints -------------------------------------------------------------------------
    def counters_state(self) -> Dict[str, int]:
        loader = self.training_dataloader if isinstance(self.training_dataloader, DistributedDataLoader) else None
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                # the accumulation the micro steps count in (another world size may resume with another)
                "gradient_accumulation_steps": self.batch.gradient_accumulation_steps,
                "dataloader_epoch": loader.epoch if loader else 0,
                "dataloader_offset": loader.offset() if loader else 0}

    def load_counters_state(self, state: Dict[str, int]) -> None:
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        self.global_samples = state["global_samples"]
        self.skipped_steps = state["skipped_steps"]
        if isinstance(self.training_dataloader, DistributedDataLoader):
            self.training_dataloader.load_state_dict({"epoch": state.get("dataloader_epoch", 0),
                                                      "offset": state.get("dataloader_offset", 0)})
        self._update_compression()

    def get_sequence_parallel_group(self):
        """The process group of this rank's sequence axis (DistributedAttention's group)."""
        return self.seq_parallel_group

    @property
    def checkpoint_mp_rank(self) -> int:
        """DeepSpeed's: the model-parallel rank this rank's checkpoint files are named by
        (mp_rank_XX): its tensor rank, 0 without tensor parallelism."""
        return self.mesh.rank("tensor")

    def _checkpoint_run(self) -> checkpoint.Run:
        """What checkpoint/ sees of this engine for one save or load: plain values as of now,
        and the objects that own state (it never gets the engine itself)."""
        m, ep = self.mesh, self.expert_parallel_size
        place = checkpoint.Placement(self.global_rank, m.rank("data"), m.size("data"), m.rank("pipe"), m.size("pipe"),
                                     m.rank("tensor"), m.size("tensor"))
        return checkpoint.Run(
            module=self.module, strategy=self.strategy, place=place, local_rank=self.local_rank,
            world_size=self.world_size, config=self.config, compute_dtype=self.compute_dtype,
            loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler, global_steps=self.global_steps,
            skipped_steps=self.skipped_steps, global_samples=self.global_samples, counters=self.counters_state(),
            accumulation=self.gradient_accumulation_steps(), restore_counters=self.load_counters_state,
            expert_parallel_size=ep, expert_rank=m.rank("expert") if ep > 1 else 0,
            expert_data_rank=m.rank("expert_data") if ep > 1 else place.dp_rank,
            expert_data_size=m.size("expert_data") if ep > 1 else place.dp_size)

    def _refuse_unsupported_checkpoint(self, what: str) -> None:
        if self.optimizer is None:
            # the checkpoint layout stores the weights with the optimizer's state (ZeRO-3: in the
            # fp32 shards), which a forward-only engine does not have
            raise checkpoint.CheckpointError(f"{what}: this engine has no optimizer (forward only), and checkpoints "
                                             "are written with the optimizer's state; save the weights with "
                                             "save_16bit_model() or the module's state_dict instead")
        # ZeRO state is sharded over data x sequence ranks, which DeepSpeed's file layout
        # (one shard per data-parallel rank) does not name
        if self.seq_parallel_size > 1:
            raise checkpoint.CheckpointError(f"{what}: checkpoints with sequence_parallel_size "
                                             f"{self.seq_parallel_size} are not supported; save the weights with "
                                             "the module's state_dict on one rank instead")

    def save_checkpoint(self, save_dir: str, tag=None, client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        allow_pickle: bool = False) -> str:
        """DeepSpeed's save_checkpoint, its argument order kept; exclude_frozen_parameters leaves
        the parameters that do not train out of the module state (loading such a checkpoint then
        needs load_module_strict=False, as in DeepSpeed). allow_pickle=True lets client_state
        hold objects that need pickle (they are then loaded only with
        load_checkpoint(..., trust_pickle=True))."""
        if save_dir is None or str(save_dir) == "":  # DeepSpeed: a ValueError, before any collective
            raise checkpoint.CheckpointDirError(f"save_checkpoint: save_dir is {save_dir!r}; pass the directory "
                                                "to write the checkpoint into")
        self._refuse_unsupported_checkpoint("save_checkpoint")  # before any file or folder is made
        return checkpoint.save(self._checkpoint_run(), save_dir, tag, client_state, save_latest=save_latest,
                               allow_pickle=allow_pickle, exclude_frozen_parameters=exclude_frozen_parameters)

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag, expp_rank: int) -> str:
        """DeepSpeed's name: the path of expert-parallel rank `expp_rank`'s optimizer file in an
        MoE checkpoint, as the writer names it."""
        return os.path.join(checkpoints_path, str(tag), checkpoint.moe.expp_file_name(expp_rank))

    def _change_recovery_script_permissions(self, dst: str) -> None:
        """DeepSpeed's name for making the saved zero_to_fp32.py executable, where a file
        share that refuses it is logged, not raised."""
        checkpoint.saving.make_executable(dst)

    def load_checkpoint(self, load_dir: str, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, trust_pickle: bool = False):
        """DeepSpeed's load_checkpoint: (path, client_state). Files are read with
        weights_only=True unless trust_pickle=True."""
        self._refuse_unsupported_checkpoint("load_checkpoint")
        return checkpoint.load(self._checkpoint_run(), load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               trust_pickle=trust_pickle)

    # -- moving ZeRO's states off the accelerator between phases (zero/offload_states.py) ------
    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the ZeRO states named in `include` (OffloadStateTypeEnum; all when None) to
        `device` (cpu), page-locked when pin_memory; reload_states() brings them back."""
        offload_strategy_states(self.strategy, include, device, pin_memory, non_blocking)

    def _get_zero_param_shapes(self) -> List["OrderedDict[str, torch.Size]"]:
        """DeepSpeed's param_shapes of this engine's ZeRO partition, as its checkpoints record
        them: one ordered dict of parameter name -> torch.Size per param group (ZeRO-3: per
        sub-group of sub_group_size elements). Read from the layout, so no collective."""
        stage = self.config.zero_optimization.stage
        if stage == 3:
            s = self.strategy
            return dsformat.stage3_param_shapes({"world_size": s.world, "groups": s.groups},
                                                s.shard_layout().sub_group_size)
        if stage in (1, 2):
            return dsformat.stage12_param_shapes({"groups": [{"shapes": {n: p.shape for n, p in zip(g.names, g.params)}}
                                                             for g in self.strategy.groups]})
        raise FragmentError("_get_zero_param_shapes: ZeRO stage 0 partitions nothing, so there are no ZeRO "
                            "parameter shapes")

    def empty_partition_cache(self) -> None:
        """DeepSpeed's name: at ZeRO-3, free the full copies of gathered parameters, persistent
        ones too (the next forward gathers them again); at stages 0-2 parameters are never
        split, so nothing changes."""
        self.strategy.empty_partition_cache()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Put every state offload_states moved back on the device it came from."""
        reload_strategy_states(self.strategy, non_blocking)

    def destroy(self) -> None:
        self.strategy.close()
        self.monitor.close()
        self._gc.release()

    # -- Hugging Face Trainer / Accelerate -----------------------------------------------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Collective: the full state_dict on rank 0 (CPU, compute dtype), None elsewhere."""
        if self.config.zero_optimization.stage != 3:
            raise ValueError("this function requires ZeRO-3 mode (zero_optimization.stage is "
                             f"{self.config.zero_optimization.stage})")
        return model_export.gathered_state_dict(self.module, exclude_frozen_parameters)

    @property
    def sparse_tensor_module_names(self) -> set:
        """DeepSpeed's set of the embeddings whose gradients it reduces sparse: always empty
        here, since sparse_gradients is refused and every gradient is reduced dense."""
        return set()

    def autotp_size(self) -> int:
        """DeepSpeed's accessor: the tensor-parallel size (tensor_parallel.autotp_size, 1 without AutoTP)."""
        return self.config.tensor_parallel.size

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """Collective: the full state_dict on rank 0 (CPU), None elsewhere, where the weights are
        split: ZeRO-3 (frozen parameters left out on request), or AutoTP (tensor_parallel
        size > 1: every parameter, as DeepSpeed's tensor-parallel path gives)."""
        if self.config.zero_optimization.stage == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.config.tensor_parallel.size > 1:
            return model_export.tensor_parallel_state_dict(self.module)
        raise ValueError("consolidated_16bit_state_dict needs split weights: zero_optimization.stage 3 or "
                         "tensor_parallel.autotp_size > 1")

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        return model_export.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model
