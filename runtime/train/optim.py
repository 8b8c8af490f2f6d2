"""Optimizers by their DeepSpeed config names, built for where their step will run.

The config's `type` names the algorithm; `OptimizerTarget` (offload or not, CUDA or CPU)
picks the implementation, as DeepSpeed does:

  type                          offload_optimizer cpu/nvme   CUDA, no offload   CPU, no offload
  Adam (AdamW unless            DeepSpeedCPUAdam (C++ SIMD)  FusedAdam (CUDA)   FusedAdam (C++ SIMD CPU kernel)
    adam_w_mode false), AdamW
  Lion                          DeepSpeedCPULion (C++ SIMD)  FusedLion (torch ops, as Lion)
  Adagrad                       CPUAdagrad (C++ SIMD)        torch.optim.Adagrad
  Lamb                          Lamb (torch ops, DeepSpeed's FusedLamb maths) everywhere
  CPUAdam / DeepSpeedCPUAdam, CPULion / DeepSpeedCPULion, CPUAdagrad / DeepSpeedCPUAdagrad,
  FusedAdam, FusedLion, FusedLamb: that implementation by name, with DeepSpeed's arguments
  SGD, RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor: torch.optim's

Muon (DeepSpeed's MuonWithAuxAdam: Muon on hidden 2-D weights, Adam(W) on the rest; see
dslaunch.runtime.core.muon) takes its Adam half from the same table as Adam.

Refused with the reason: the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb), the
muP ones (MuAdam, MuAdamW, MuSGD), LBFGS and SparseAdam. So the object
`initialize` returns says what steps the parameters (CPUAdam, FusedAdam, AdamW, ...), and
`dslaunch.kernels.describe(optimizer)` says which kernel does it. Parameter names are
checked against each builder's signature: a misspelt "lr" is an error, not a default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from .lr_schedules import check_params
from ..core.strict import ConfigError, suggest


@dataclass(frozen=True)
class OptimizerTarget:
    """Where the step runs: on fp32 host masters (offload_optimizer cpu/nvme), else on the
    device of the parameters."""

    offload: bool = False
    cuda: bool = False
    # low-precision masters (the precision policy's): the step runs on bf16 master partitions, with
    # moments in `state_dtype`; DeepSpeed then builds DeepSpeedCPUAdam under offload
    master_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, config, device: torch.device, precision=None) -> "OptimizerTarget":
        master = precision.master if precision is not None else torch.float32
        state = precision.optimizer_state if precision is not None else torch.float32
        return cls(offload=config.zero_optimization.offload_optimizer_device != "none", cuda=device.type == "cuda",
                   master_dtype=master, state_dtype=state)


def _only_fp32_states(fp32_optimizer_states: bool, target: Optional[OptimizerTarget] = None) -> None:
    # DeepSpeedCPUAdam(..., fp32_optimizer_states=False) keeps a bf16/fp16 parameter's moments in
    # its dtype when a script steps such parameters itself; the engine's optimizer steps fp32
    # masters, whose moments are fp32 either way, so the key would do nothing there. Beside
    # low-precision masters the precision policy says the moments' dtype (under CPU offload, false
    # makes them the masters' dtype, as DeepSpeed's DeepSpeedCPUAdam); on the device the moments
    # are bf16.bf16_optimizer_states' dtype, and false beside fp32 ones would do nothing.
    if target is not None and target.master_dtype != torch.float32:
        if not fp32_optimizer_states and target.state_dtype == torch.float32:
            raise ConfigError("optimizer.params.fp32_optimizer_states: false beside low-precision masters on the "
                              "device would do nothing (the moments follow bf16.bf16_optimizer_states there; "
                              "under CPU offload false keeps them in the masters' dtype)")
        return
    if not fp32_optimizer_states:
        raise ConfigError("optimizer.params.fp32_optimizer_states: false (bf16/fp16 moments) would do nothing: "
                          "the engine's optimizer steps fp32 master parameters, whose moments are fp32")


def _adam_impl(params, target: OptimizerTarget, adam_w_mode: bool, torch_adam: bool, **kw):
    betas = tuple(kw.pop("betas"))
    if torch_adam:  # DeepSpeed's switch to torch's implementation, wherever the step runs
        if not kw.pop("bias_correction"):
            raise ConfigError("optimizer.params.bias_correction: false is not available with torch_adam: true")
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        if kw.get("weight_decay") is None:
            # DeepSpeed hands the config's params to torch's class as they are: an unset decay is
            # that class's default (AdamW 0.01, Adam 0), not the 0 of its own kernels
            kw.pop("weight_decay", None)
        optimizer = cls(params, betas=betas, **kw)
        optimizer.torch_step_requested = True  # offload then runs this step, not a kernel
        return optimizer
    from dslaunch.runtime.train.ops.adam import DeepSpeedCPUAdam, FusedAdam

    if kw.get("weight_decay") is None:
        kw["weight_decay"] = 0.0  # DeepSpeed's FusedAdam and CPU Adam default
    if target.master_dtype != torch.float32 and (target.offload or not target.cuda):
        # low-precision masters on the CPU: DeepSpeedCPUAdam steps them with fp32 maths rounded back, its
        # moments in the policy's optimizer-state dtype (DeepSpeed's engine builds the same under offload)
        return DeepSpeedCPUAdam(params, kw["lr"], kw["bias_correction"], betas, kw["eps"], kw["weight_decay"],
                                kw["amsgrad"], adam_w_mode, target.state_dtype == torch.float32)
    # The classes DeepSpeed 0.19.8's engine builds, so a script's isinstance checks and its reads of
    # adam_w_mode hold: DeepSpeedCPUAdam under offload, FusedAdam otherwise, on CUDA and on the CPU
    # alike (its CPU accelerator builds FusedAdam from its CPU Adam kernel, as ours steps CPU
    # parameters with the SIMD kernel; torch's AdamW on CPU tensors takes its per-tensor loop:
    # 12.5 ms against the kernel's 2.7 ms for GPT-lite's 3.2M parameters).
    if target.offload:
        return DeepSpeedCPUAdam(params, kw["lr"], kw["bias_correction"], betas, kw["eps"], kw["weight_decay"],
                                kw["amsgrad"], adam_w_mode)
    return FusedAdam(params, kw["lr"], kw["bias_correction"], betas, kw["eps"], adam_w_mode, kw["weight_decay"],
                     kw["amsgrad"])


def _adam(params, target, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: Optional[float] = None,
          adam_w_mode: bool = True, bias_correction: bool = True, amsgrad: bool = False, torch_adam: bool = False,
          fp32_optimizer_states: bool = True):
    _only_fp32_states(fp32_optimizer_states, target)
    return _adam_impl(params, target, adam_w_mode, torch_adam, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay, bias_correction=bias_correction, amsgrad=amsgrad)


def _adamw(params, target, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: Optional[float] = None,
           adam_w_mode: bool = True, bias_correction: bool = True, amsgrad: bool = False, torch_adam: bool = False,
           fp32_optimizer_states: bool = True):
    if not adam_w_mode:
        raise ConfigError("optimizer.params.adam_w_mode: false contradicts type AdamW; use type Adam for L2 decay")
    return _adam(params, target, lr, betas, eps, weight_decay, True, bias_correction, amsgrad, torch_adam,
                 fp32_optimizer_states)


def _cpu_adam(params, target, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
              fp32_optimizer_states: bool = True):
    from dslaunch.runtime.train.ops.adam import DeepSpeedCPUAdam

    _refuse_cuda_without_offload("CPUAdam", target)
    _only_fp32_states(fp32_optimizer_states, target)
    return DeepSpeedCPUAdam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
                            fp32_optimizer_states)


def _fused_adam(params, target, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                set_grad_none: bool = True):
    from dslaunch.runtime.train.ops.adam import FusedAdam

    if target.offload or not target.cuda:
        raise ConfigError("optimizer.type: FusedAdam steps CUDA tensors, but "
                          f"{'offload_optimizer puts the step on the CPU' if target.offload else 'there is no GPU'}; "
                          "use type Adam, which picks the kernel for where the step runs")
    return FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad, set_grad_none)


def _muon(params, target, lr: float = None, muon_lr: float = None, adam_lr: float = None, momentum: float = None,
          weight_decay: float = None, ns_method: str = None, betas=None, eps: float = None, adam_w_mode: bool = True,
          torch_adam: bool = False, fp32_optimizer_states: bool = True, per_head_muon: bool = False):
    """DeepSpeed's Muon: parameters tagged use_muon (initialize tags the model's, tagging.py)
    split into a Muon half and an Adam half; a key left out takes that half's DeepSpeed default."""
    from ..core.muon.newton_schulz import NS_METHODS
    from ..core.muon.optimizer import ADAM_DEFAULTS, MuonWithAuxAdam
    from ..core.muon.tagging import split_groups

    if per_head_muon:
        raise ConfigError("optimizer.params.per_head_muon: per-head Newton-Schulz (each attention head's block "
                          "orthogonalised apart) is not implemented here; remove it to orthogonalise whole matrices")
    if ns_method is not None and ns_method not in NS_METHODS:
        raise ConfigError(f"optimizer.params.ns_method: {ns_method!r} is not one of {', '.join(NS_METHODS)}")
    _only_fp32_states(fp32_optimizer_states)
    given = dict(lr=lr, muon_lr=muon_lr, adam_lr=adam_lr, momentum=momentum, weight_decay=weight_decay,
                 ns_method=ns_method, betas=tuple(betas) if betas is not None else None, eps=eps)
    groups = split_groups(params, {k: v for k, v in given.items() if v is not None})

    def adam(adam_groups):
        return _adam_impl(adam_groups, target, adam_w_mode, torch_adam, lr=ADAM_DEFAULTS["lr"],
                          betas=ADAM_DEFAULTS["betas"], eps=ADAM_DEFAULTS["eps"],
                          weight_decay=ADAM_DEFAULTS["weight_decay"], bias_correction=True, amsgrad=False)

    return MuonWithAuxAdam(groups, adam, adam_w_mode=adam_w_mode)


def _refuse_cuda_without_offload(name: str, target: OptimizerTarget) -> None:
    if target.cuda and not target.offload:
        raise ConfigError(f"optimizer.type: {name} steps fp32 CPU tensors, but the parameters stay on the GPU; set "
                          f"zero_optimization.offload_optimizer.device to \"cpu\", or use the type without the prefix")


def _lion(params, target, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0):
    # DeepSpeed's classes, as DeepSpeed builds them for type Lion: the CPU kernel under offload,
    # else FusedLion (here torch ops on any device, set_grad_none as DeepSpeed's)
    from dslaunch.runtime.train.ops.lion import DeepSpeedCPULion, FusedLion

    if target.offload:
        return DeepSpeedCPULion(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    return FusedLion(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)


def _cpu_lion(params, target, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
              fp32_optimizer_states: bool = True):
    from dslaunch.runtime.train.ops.lion import DeepSpeedCPULion

    _refuse_cuda_without_offload("CPULion", target)
    _only_fp32_states(fp32_optimizer_states)
    return DeepSpeedCPULion(params, lr, betas, weight_decay, fp32_optimizer_states)


def _fused_lion(params, target, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                set_grad_none: bool = True):
    from dslaunch.runtime.train.ops.lion import FusedLion

    return FusedLion(params, lr, betas, weight_decay, set_grad_none)


def _adagrad(params, target, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
             initial_accumulator_value: float = 0.0, eps: float = 1e-10, maximize: bool = False,
             fp32_optimizer_states: bool = True):
    from dslaunch.kernels import CPUAdagrad

    _only_fp32_states(fp32_optimizer_states)
    cls = CPUAdagrad if target.offload else torch.optim.Adagrad
    return cls(params, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
               initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize)


def _cpu_adagrad(params, target, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
    from dslaunch.runtime.train.ops.adagrad import DeepSpeedCPUAdagrad

    _refuse_cuda_without_offload("CPUAdagrad", target)
    _only_fp32_states(fp32_optimizer_states)
    return DeepSpeedCPUAdagrad(params, lr, eps, weight_decay, amsgrad, fp32_optimizer_states)


def _lamb(params, target, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
          eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
          min_coeff: float = 0.01, amsgrad: bool = False, _cls=None):
    from dslaunch.kernels import Lamb

    if amsgrad:
        raise ConfigError("optimizer.params.amsgrad: LAMB has no AMSGrad variant; remove it")
    return (_cls or Lamb)(params, lr, bias_correction, tuple(betas), eps, eps_inside_sqrt, weight_decay, 0.0,
                          max_coeff, min_coeff)


def _fused_lamb(params, target, **kw):
    from dslaunch.runtime.train.ops.lamb import FusedLamb

    return _lamb(params, target, **kw, _cls=FusedLamb)


_fused_lamb.signature_of = _lamb


def _torch(cls):
    """torch.optim's own class, its constructor arguments checked by name."""
    def build(params, target, **kw):
        return cls(params, **kw)
    build.signature_of = cls.__init__
    return build


OPTIMIZERS: Dict[str, Callable] = {
    "adam": _adam, "adamw": _adamw,
    "cpuadam": _cpu_adam, "deepspeedcpuadam": _cpu_adam, "fusedadam": _fused_adam,
    "lion": _lion, "cpulion": _cpu_lion, "deepspeedcpulion": _cpu_lion, "fusedlion": _fused_lion,
    "adagrad": _adagrad, "cpuadagrad": _cpu_adagrad, "deepspeedcpuadagrad": _cpu_adagrad,
    "lamb": _lamb, "fusedlamb": _fused_lamb,
    "muon": _muon,
    **{name.lower(): _torch(getattr(torch.optim, name))
       for name in ("SGD", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor")
       if hasattr(torch.optim, name)},
}

_ONE_BIT = ("1-bit optimizers compress gradients inside their own error-compensated all-reduce (DeepSpeed's "
            "NCCL/MPI compressed back-ends), which this runtime does not implement; use {0} (same maths, "
            "uncompressed communication)")
# why deepspeed.runtime.fp16.onebit (its three 1-bit optimizers' package) is refused on import
ONE_BIT_PACKAGE = _ONE_BIT.format("Adam") + " or Lamb"
REFUSED: Dict[str, str] = {
    "onebitadam": _ONE_BIT.format("Adam"),
    "zerooneadam": _ONE_BIT.format("Adam"),
    "onebitlamb": _ONE_BIT.format("Lamb"),
    **{name: "muP optimizers need the mup package's re-parametrised model; build one with mup and pass it as "
             "initialize(optimizer=...)" for name in ("muadam", "muadamw", "musgd")},
    "lbfgs": "LBFGS re-evaluates the loss through a closure on every step, which engine.step() does not take",
    "sparseadam": "SparseAdam needs sparse gradients, which the engine's gradient reduction does not produce",
}

KNOWN = "Adam, AdamW, Lion, Adagrad, Lamb, Muon, CPUAdam, FusedAdam, SGD, RMSprop, ... (see docs/optimizers.md)"


def build_optimizer(opt_cfg, params, target: OptimizerTarget = OptimizerTarget()) -> torch.optim.Optimizer:
    name = opt_cfg.type.lower()
    if name in REFUSED:
        raise ConfigError(f"optimizer.type: {opt_cfg.type} is not supported: {REFUSED[name]}")
    builder = OPTIMIZERS.get(name)
    if builder is None:
        raise ConfigError(f"optimizer.type: unknown optimizer {opt_cfg.type!r}"
                          f"{suggest(name, list(OPTIMIZERS) + list(REFUSED))} (known: {KNOWN})")
    if "max_grad_norm" in opt_cfg.params:
        raise ConfigError("optimizer.params.max_grad_norm: not an optimizer parameter; clip with the config's "
                          "\"gradient_clipping\" (as DeepSpeed requires)")
    check_params("optimizer", opt_cfg.type, getattr(builder, "signature_of", builder), opt_cfg.params,
                 skip=("self", "params", "target", "_cls"))
    return builder(params, target, **opt_cfg.params)
