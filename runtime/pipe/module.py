"""PipelineModule: a sequence of layers, cut into stages, each built only where it runs.

    net = PipelineModule(layers=model.to_layers(), num_stages=2, loss_fn=nn.CrossEntropyLoss())
    engine, *_ = deepspeed.initialize(model=net, config=cfg)      # a PipelineEngine
    loss = engine.train_batch(data_iter)

Layers, in forward order (the output of one is the input of the next; a tuple is passed
on as one object):
    an nn.Module                    used as is (registered only on the stage that owns it)
    LayerSpec(cls, *args, **kw)     built (cls(*args, **kw)) only on the owning stage
    TiedLayerSpec(key, cls, ...)    one module per key, shared by every layer with that key;
                                    on different stages the tied weights (tied_weight_attr)
                                    are kept equal: broadcast at start, gradients summed
                                    over the stages that hold them before each step
    any other callable              e.g. a lambda; no parameters, run as a function

virtual_stages=v (> 1, for the interleaved 1F1B schedule) cuts the layers into p * v
model chunks; stage s holds chunks s, s + p, s + 2p, ... and runs one with forward(x, chunk=c).

Each stage's registered submodules are named by their global layer index ("3.weight"),
tied modules as "tied_modules.<key>....", so parameter names do not depend on where the
stages are cut: checkpoints and ZeRO shards keyed by them load at any pipeline depth.
"""
from __future__ import annotations

import os
from functools import partial
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..core import comm
from ..core.strict import ConfigError
from ..core.parallel import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology, TopologyError
from .partition import PartitionError, check_parts, layer_name, partition_layers


class PipelineError(ConfigError):
    """A pipeline used in a way it cannot run; one line, exit status 2 when uncaught."""


class LayerSpec:
    """A layer to construct later, only on the stage that owns it."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise PipelineError(f"LayerSpec: {typename!r} is not a torch.nn.Module class")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared with every other TiedLayerSpec of the same `key`
    (e.g. the token embedding and the LM head). `forward_fn(module, x)` replaces the
    module's forward where given; `tied_weight_attr` names the shared attribute(s)."""

    def __init__(self, key: str, typename, *module_args, forward_fn: Optional[Callable] = None,
                 tied_weight_attr="weight", **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _trainable_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _count_params(layer) -> int:
    """Trainable parameters of one layer, without allocating a spec's weights (built on the
    meta device; a constructor that cannot run there is built for real)."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                return _trainable_numel(layer.build())
        except Exception:  # e.g. a constructor that reads its freshly made tensors
            return _trainable_numel(layer.build())
    if isinstance(layer, nn.Module):
        return _trainable_numel(layer)
    return 0


def _ensure_distributed() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        from ..core import comm

        comm.init_distributed()


def _get_attr(module: nn.Module, dotted: str) -> torch.Tensor:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class PipelineModule(nn.Module):
    def __init__(self, layers, num_stages: Optional[int] = None, topology: Optional[ProcessTopology] = None,
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Optional[Callable] = None, checkpointable_layers: Optional[List[str]] = None,
                 dynamic_shape: bool = False, virtual_stages: int = 1):
        super().__init__()
        if num_stages is None and topology is None:
            raise PipelineError("PipelineModule: give num_stages or topology")
        if not (isinstance(virtual_stages, int) and virtual_stages >= 1):
            raise PipelineError(f"PipelineModule: virtual_stages must be an integer >= 1, got {virtual_stages!r}")
        if activation_checkpoint_interval < 0:
            raise PipelineError(f"PipelineModule: activation_checkpoint_interval must be >= 0, "
                                f"got {activation_checkpoint_interval}")
        _ensure_distributed()
        import torch.distributed as dist

        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._topo = self._make_topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self.virtual_stages = virtual_stages

        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        # DeepSpeed's cache of which blocks of `activation_checkpoint_interval` layers forward
        # checkpoints, rebuilt whenever the interval changes (_precompute_checkpointable_values)
        self.is_checkpointable_results: List[bool] = []
        self.is_checkpointable_results_interval: Optional[int] = None
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0

        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        try:
            # parts[k]..parts[k + 1] are virtual stage k's layers (k = chunk * num_stages + stage)
            self.parts = partition_layers(self._layer_specs, self.num_stages * virtual_stages, partition_method,
                                          _count_params)
            check_parts(self.parts, self._num_layers)
        except PartitionError as exc:
            raise PipelineError(str(exc)) from None
        # the grid's groups are made only now: every check above runs on each rank alike
        # without communicating, so a bad pipeline stops all ranks at the same point (a
        # rank that leaves while the others make groups takes their rendezvous store along)
        try:
            self._grid = PipelineParallelGrid(self._topo)
        except TopologyError as exc:
            raise PipelineError(f"PipelineModule: {exc}") from None
        self.stage_id = self._grid.get_stage_id()
        self.chunk_layers = [(self.parts[vs], self.parts[vs + 1]) for vs in self._virtual_stages_of(self.stage_id)]
        self._local_start, self._local_stop = self.chunk_layers[0][0], self.chunk_layers[-1][1]

        self.forward_funcs: List[Callable] = []
        self._func_layer: List[int] = []  # global layer index of each forward function
        self._chunk_funcs: List[Tuple[int, int]] = []  # each chunk's range in forward_funcs
        self.fwd_map: Dict[str, int] = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: Dict[str, List[str]] = {}
        self._build()
        from ..core.accelerator import get_accelerator

        self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()
        # One-rank groups are made by their member alone, through the rendezvous store that
        # rank 0 holds: wait until every rank has made its groups, so that an error found
        # next (the same on every rank) cannot take the store away from a rank still at it.
        comm.barrier(group=comm.get_world_group(), label="pipeline groups made")

    # -- construction ---------------------------------------------------------------------------
    def _make_topology(self, num_stages, topology) -> ProcessTopology:
        from ..core import comm

        if topology is not None:
            if num_stages is not None and num_stages != topology.get_dim("pipe"):
                raise PipelineError(f"PipelineModule: num_stages={num_stages} but the topology has "
                                    f"{topology.get_dim('pipe')} pipe stages")
            if topology.world_size() != self.world_size:
                raise PipelineError(f"PipelineModule: the topology {topology} has {topology.world_size()} ranks "
                                    f"but the job has {self.world_size} ({comm.world_source()})")
            return topology
        if num_stages < 1 or self.world_size % num_stages:
            raise PipelineError(f"PipelineModule: num_stages={num_stages} does not divide the world size "
                                f"{self.world_size} ({comm.world_source()})")
        return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)

    def _seed(self, seed: int) -> None:
        if self.seed_fn is not None:
            self.seed_fn(seed)
        else:
            torch.manual_seed(seed)

    def _virtual_stages_of(self, stage: int) -> List[int]:
        return [c * self.num_stages + stage for c in range(self.virtual_stages)]

    def _build(self) -> None:
        for lo, hi in self.chunk_layers:
            first = len(self.forward_funcs)
            for idx in range(lo, hi):
                self._build_layer(idx)
                self._func_layer.append(idx)
            self._chunk_funcs.append((first, len(self.forward_funcs)))

    def _build_layer(self, idx: int) -> None:
        layer = self._layer_specs[idx]
        if self.seed_layers:
            self._seed(self.base_seed + idx)
        if isinstance(layer, PipelineModule):
            raise PipelineError(f"PipelineModule: layer {idx} is itself a PipelineModule (nesting is not supported)")
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
        elif isinstance(layer, (nn.Module, LayerSpec)):
            module = layer.build() if isinstance(layer, LayerSpec) else layer
            self.add_module(str(idx), module)
            self.fwd_map[str(idx)] = len(self.forward_funcs)
            self.forward_funcs.append(module)
        elif callable(layer):
            self.forward_funcs.append(layer)
        else:
            raise PipelineError(f"PipelineModule: layer {idx} ({type(layer).__name__}) is neither a module, "
                                "a LayerSpec nor a callable")

    def _index_tied_modules(self) -> Dict[str, Dict[str, Any]]:
        """One group per tie key and data replica (and tensor slice): the ranks of the
        stages holding that key. Collective: every rank creates every group, in key order."""
        comms: Dict[str, Dict[str, Any]] = {}
        if self.num_stages == 1:
            return comms
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        for key in keys:
            stages = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})
            for dp in range(self._grid.get_data_parallel_world_size()):
                for mp in range(self._grid.get_slice_parallel_world_size()):
                    extra = {"data": dp}
                    if "model" in self._topo.get_axis_names():
                        extra["model"] = mp
                    ranks = [self._grid.stage_to_global(s, **extra) for s in stages]
                    group = self._grid.new_group(ranks)
                    if self.global_rank in ranks:
                        comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                      "module": self.tied_modules[key]}
        return comms

    def _synchronize_tied_weights(self) -> None:
        for key, c in self.tied_comms.items():
            if len(c["ranks"]) > 1:
                for attr in c["weight_attr"]:
                    comm.broadcast(_get_attr(c["module"], attr).data, src=min(c["ranks"]), group=c["group"],
                                   label=f"tied weight {key}.{attr}")

    # -- tied weights ------------------------------------------------------------------------------
    def get_tied_weights_and_groups(self):
        """[(weight, group)] for every tied weight this stage shares with another stage."""
        return [(_get_attr(c["module"], attr), c["group"]) for c in self.tied_comms.values()
                if len(c["ranks"]) > 1 for attr in c["weight_attr"]]

    def allreduce_tied_weight_gradients(self) -> None:
        for weight, group in self.get_tied_weights_and_groups():
            if weight.grad is not None:
                comm.all_reduce(weight.grad, group=group, label="tied weight grad")

    # -- forward -----------------------------------------------------------------------------------
    def _run(self, start: int, end: int, offset: int):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for i in range(start, end):
                if self.seed_layers:  # the same dropout masks wherever the layer runs
                    self._seed(self.base_seed * offset + self._func_layer[i])
                x = self.forward_funcs[i](x)
            return x
        return run

    def _funcs_of(self, chunk: Optional[int]) -> Tuple[int, int]:
        if chunk is None:
            if self.virtual_stages > 1:
                raise PipelineError(f"PipelineModule: this stage holds {self.virtual_stages} model chunks; "
                                    "run one with forward(x, chunk=c)")
            return 0, len(self.forward_funcs)
        if not 0 <= chunk < self.virtual_stages:
            raise PipelineError(f"PipelineModule: chunk {chunk} does not exist ({self.virtual_stages} per stage)")
        return self._chunk_funcs[chunk]

    def _checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)

    def _precompute_checkpointable_values(self) -> None:
        """Which blocks of activation_checkpoint_interval layers (counted from the first local
        layer, as forward cuts them) are checkpointed; kept until the interval changes."""
        k = self.activation_checkpoint_interval
        if k > 0 and self.is_checkpointable_results_interval != k:
            n = len(self.forward_funcs)
            self.is_checkpointable_results = [self._checkpointable(self.forward_funcs[i:min(i + k, n)])
                                              for i in range(0, n, k)]
            self.is_checkpointable_results_interval = k

    def forward(self, forward_input, chunk: Optional[int] = None):
        lo, n = self._funcs_of(chunk)
        self.micro_offset += 1
        offset = self.micro_offset + 1
        k = self.activation_checkpoint_interval
        if k == 0 or not torch.is_grad_enabled():
            return self._run(lo, n, offset)(forward_input)
        self._precompute_checkpointable_values()
        x = forward_input
        for start in range(lo, n, k):
            end = min(start + k, n)
            fn = self._run(start, end, offset)
            args = x if isinstance(x, tuple) else (x,)
            # a virtual stage's chunk is part of the list, off the cached blocks' grid: decided in place
            checkpointed = self.is_checkpointable_results[start // k] if (lo, n) == (0, len(self.forward_funcs)) \
                else self._checkpointable(self.forward_funcs[start:end])
            if checkpointed:
                if self.activation_checkpoint_func is not None:
                    x = self.activation_checkpoint_func(fn, *args)
                else:
                    from torch.utils.checkpoint import checkpoint

                    x = checkpoint(fn, *args, use_reentrant=False)
            else:
                x = fn(*args)
        return x

    def forward_split(self, forward_input, chunk: Optional[int] = None) -> Tuple[Any, List["Piece"]]:
        """forward() with every layer run on a detached copy of its input, for a backward
        split into its input-gradient and weight-gradient halves (ZB-H1): each layer's graph
        then ends at its own input, so its weight gradients can be taken later from the
        gradient of its output alone, without running backward through the layers before
        it again. Returns the output and one Piece per layer."""
        lo, n = self._funcs_of(chunk)
        self.micro_offset += 1
        offset = self.micro_offset + 1
        x, pieces = forward_input, []
        inputs = floating_leaves(x)
        for i in range(lo, n):
            if i > lo:
                x, inputs = detach_floating(x)
            y = self._run(i, i + 1, offset)(*(x if isinstance(x, tuple) else (x,)))
            pieces.append(Piece(inputs, floating_leaves(y)))
            x = y
        return x, pieces

    # -- DeepSpeed's accessors -------------------------------------------------------------------
    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise PipelineError(f"activation_checkpoint_interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def partitions(self) -> List[int]:
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise PipelineError(f"layer {layer_idx} does not exist (the pipeline has {self._num_layers} layers)")
        vs = next(k for k in range(len(self.parts) - 1) if self.parts[k] <= layer_idx < self.parts[k + 1])
        return vs % self.num_stages

    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    @property
    def parallel_mesh(self) -> PipelineParallelGrid:
        """The process mesh this module was cut for: the engine runs on it (runtime/core/parallel/select.py)."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def local_layers(self):
        """[(global layer index, forward function)] of this stage, in order."""
        return list(zip(self._func_layer, self.forward_funcs))

    def layer_state_prefixes(self, own: bool = False) -> Dict[int, str]:
        """Global layer index -> the state_dict prefix its weights have in this module ("3",
        or "tied_modules.<key>" for a tied layer run by the module itself), for every layer
        that has weights of its own (functions and tied layers with a forward_fn have none);
        `own`: only this stage's layers."""
        out = {}
        for idx in (self._func_layer if own else range(self._num_layers)):
            spec = self._layer_specs[idx]
            if isinstance(spec, TiedLayerSpec):
                if spec.forward_fn is None:
                    out[idx] = f"tied_modules.{spec.key}"
            elif isinstance(spec, (nn.Module, LayerSpec)):
                out[idx] = str(idx)
        return out

    def stage_param_counts(self) -> List[int]:
        """Trainable parameters each stage owns, per virtual stage (the stage itself unless
        virtual_stages > 1; the same answer on every rank; a tied module counts once per
        virtual stage that holds it)."""
        counts = []
        for s in range(len(self.parts) - 1):
            specs = self._layer_specs[self.parts[s]:self.parts[s + 1]]
            seen, n = set(), 0
            for spec in specs:
                if isinstance(spec, TiedLayerSpec):
                    if spec.key in seen:
                        continue
                    seen.add(spec.key)
                n += _count_params(spec)
            counts.append(n)
        return counts

    def layer_names(self) -> List[str]:
        return [layer_name(layer) for layer in self._layer_specs]

    def get_additional_losses(self):
        return None


def to_layers_prefixes(model: nn.Module) -> Dict[int, str]:
    """Layer index in `model.to_layers()` -> that layer module's name inside `model` (the
    prefix its weights have in model.state_dict()); functions are left out."""
    to_layers = getattr(model, "to_layers", None)
    if not callable(to_layers):
        raise PipelineError(f"{type(model).__name__} has no to_layers(): its layers cannot be matched to a pipeline's")
    names = {id(m): n for n, m in model.named_modules()}
    return {idx: names[id(layer)] for idx, layer in enumerate(to_layers())
            if isinstance(layer, nn.Module) and id(layer) in names}


def from_pipeline_state(model: nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """A state_dict under PipelineModule names ("3.weight", e.g. from `dslaunch consolidate`
    of a pipeline checkpoint) re-keyed for `model`, the same layers without a pipeline,
    through its to_layers(): model.load_state_dict(from_pipeline_state(model, state))."""
    prefixes = to_layers_prefixes(model)
    out = {}
    for key, value in state.items():
        idx, _, rest = key.partition(".")
        if not idx.isdecimal() or int(idx) not in prefixes:
            raise PipelineError(f"{key}: not the weight of a module layer of {type(model).__name__}.to_layers()")
        prefix = prefixes[int(idx)]
        out[f"{prefix}.{rest}" if prefix else rest] = value
    return out


@dataclass
class Piece:
    """One layer's share of a split forward: the floating-point tensors it took (leaves
    that end its graph; for the stage's first layer, its input itself) and the ones it gave
    (aligned with the next piece's inputs); `grads` holds its outputs' gradients from the
    input-gradient half until the weight-gradient half uses them."""

    inputs: List[torch.Tensor]
    outputs: List[torch.Tensor]
    grads: Optional[List[torch.Tensor]] = field(default=None, repr=False)


def floating_leaves(x) -> List[torch.Tensor]:
    return [t for t in (x if isinstance(x, tuple) else (x,)) if torch.is_tensor(t) and t.is_floating_point()]


def detach_floating(x) -> Tuple[Any, List[torch.Tensor]]:
    """x with each floating-point tensor replaced by a leaf of the same value (requiring a
    gradient where the original did); the leaves, in order."""
    leaves = []

    def cut(t):
        if torch.is_tensor(t) and t.is_floating_point():
            leaf = t.detach().requires_grad_(t.requires_grad)
            leaves.append(leaf)
            return leaf
        return t
    out = tuple(cut(t) for t in x) if isinstance(x, tuple) else cut(x)
    return out, leaves
