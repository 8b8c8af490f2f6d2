"""Optimizers by their DeepSpeed config names.

DeepSpeed's "Adam" decouples weight decay by default (adam_w_mode=true, i.e. AdamW); set
"adam_w_mode": false for L2-style Adam. Parameter names are checked against each
builder's signature so a misspelt "lr" is an error, not a silent default.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from .lr_schedules import check_params
from .strict import ConfigError, suggest


def _adam(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          adam_w_mode: bool = True, torch_adam: bool = False, amsgrad: bool = False):
    # torch_adam only selects the implementation in DeepSpeed; both are torch's here.
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def _adamw(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
           amsgrad: bool = False, torch_adam: bool = False):
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def _sgd(params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
         nesterov: bool = False):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                           nesterov=nesterov)


def _adagrad(params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10):
    return torch.optim.Adagrad(params, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps)


def _rmsprop(params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
             momentum: float = 0.0, centered: bool = False):
    return torch.optim.RMSprop(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                               centered=centered)


# Other packages (the CPU/fused Adam kernels) may add entries; keys are matched case-insensitively.
OPTIMIZERS: Dict[str, Callable] = {"adam": _adam, "adamw": _adamw, "sgd": _sgd, "adagrad": _adagrad,
                                   "rmsprop": _rmsprop}


def build_optimizer(opt_cfg, params) -> torch.optim.Optimizer:
    builder = OPTIMIZERS.get(opt_cfg.type.lower())
    if builder is None:
        raise ConfigError(f"optimizer.type: unknown optimizer {opt_cfg.type!r}"
                          f"{suggest(opt_cfg.type.lower(), OPTIMIZERS)} (known: Adam, AdamW, SGD, Adagrad, RMSprop)")
    check_params("optimizer", opt_cfg.type, builder, opt_cfg.params)
    return builder(params, **opt_cfg.params)
