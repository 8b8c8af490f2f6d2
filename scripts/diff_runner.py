"""One case of scripts/diff_vs_deepspeed.py, run inside one rank: the training script both
engines run. `rt` is `deepspeed` (real DeepSpeed, in its own environment) or
`dslaunch.runtime`; nothing else differs. Needs only torch (and transformers for the
Hugging Face models), so it runs unchanged under either Python.

What a run returns (rank 0's is kept): the loss of every micro-step (averaged over the
ranks), the loss of the evaluation forward, the engine's global and skipped step counts,
and the module's parameters at the end as one flat fp32 list (gathered at ZeRO-3; rank 0's
shard under tensor parallelism is not compared, its losses are). A refusal is
{"error": "Type: first line", "lines": how many lines the message has}.
"""
from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from diff_cases import Case

IN, HID, OUT = 6, 16, 4          # the MLP family
VOCAB, DIM, SEQ = 16, 8, 6       # the language models
MOE_H, MOE_EXPERTS, MOE_TOKENS = 8, 4, 4  # tokens per row: DeepSpeed's gate wants min_capacity (4) per rank
LR = {"adam": 0.01, "adamw": 0.01, "adam_l2": 0.01, "torch_adamw": 0.01, "adagrad": 0.05, "sgd": 0.1,
      "rmsprop": 0.005, "lion": 0.002, "lamb": 0.01, "client_adamw": 0.01, "client_sgd": 0.1}


# -- models ------------------------------------------------------------------------------------
def _seeded(module: nn.Module, seed: int = 0, scale: float = 0.4) -> nn.Module:
    """Weights from a generator, by sorted parameter name: the same on both sides whatever
    the library's own initialisation draws (normalisation layers: weight 1, bias 0)."""
    g = torch.Generator().manual_seed(seed)
    norms = {name for name, m in module.named_modules() if "Norm" in type(m).__name__}
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            if owner in norms:
                p.fill_(1.0) if leaf == "weight" else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return module


class MLP(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(IN, HID)
        if kind == "buffers":
            self.norm = nn.BatchNorm1d(HID)
            self.register_buffer("shift", torch.linspace(-0.5, 0.5, OUT))
        if kind == "unused":
            self.spare = nn.Linear(HID, HID)  # forward never calls it
        if kind == "shared":
            self.b = nn.Linear(HID, HID)
            self.c = nn.Linear(HID, HID)
            self.c.weight = self.b.weight  # one parameter, two modules
        self.out = nn.Linear(HID, OUT)
        _seeded(self)
        if kind == "frozen":
            self.a.requires_grad_(False)

    def forward(self, x):
        h = self.a(x)
        if self.kind == "buffers":
            h = self.norm(h)
        h = torch.tanh(h)
        if self.kind == "shared":
            h = torch.tanh(self.c(torch.tanh(self.b(h))))
        y = self.out(h)
        if self.kind == "buffers":
            y = y + self.shift.to(y.dtype)
        return y


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        _seeded(self)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class Block(nn.Module):
    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no bias: a key bias moves every score of a row alike, so softmax gives it a zero gradient, and
        # Adam turns the rounding noise left in its place into full-size steps that differ run to run
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.ff(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.block = Block()
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        _seeded(self)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return self.head(self.ln_f(self.block(x)))


def hf_llama(tied: bool):
    """A one-layer Hugging Face Llama from a config (no biases anywhere, so no key bias: see
    Block); tied: its output layer is its input embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM * 2, intermediate_size=DIM * 4, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2 if tied else 4, max_position_embeddings=SEQ,
                      tie_word_embeddings=tied, attn_implementation="eager")
    return _seeded(LlamaForCausalLM(cfg), scale=0.1)


class MoENet(nn.Module):
    def __init__(self, rt, ep: int, ep_rank: int):
        super().__init__()
        layer = importlib.import_module(rt.__name__ + ".moe.layer")
        self.inp = nn.Linear(IN, MOE_H)
        expert = nn.Sequential(nn.Linear(MOE_H, MOE_H), nn.ReLU(), nn.Linear(MOE_H, MOE_H))
        self.moe = layer.MoE(MOE_H, expert, num_experts=MOE_EXPERTS, ep_size=ep, k=1, drop_tokens=False,
                             use_rts=False)
        self.out = nn.Linear(MOE_H, OUT)
        _seeded(self.inp, 1)
        _seeded(self.out, 2)
        _seeded(self.moe.deepspeed_moe.gate, 3)
        local = MOE_EXPERTS // ep
        for i, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):  # by global expert id
            _seeded(e, 100 + ep_rank * local + i)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        m, l_aux, _ = self.moe(h)
        return self.out(h + m), l_aux


def build_model(rt, case: Case, rank: int) -> nn.Module:
    torch.manual_seed(0)
    if case.model in ("mlp", "frozen", "unused", "buffers", "shared"):
        return MLP(case.model)
    if case.model == "tied":
        return TiedLM()
    if case.model == "gpt":
        return GPT()
    if case.model == "hf":
        return hf_llama(tied=True)
    if case.model == "tp":
        return hf_llama(tied=False)
    if case.model == "moe":
        return MoENet(rt, case.ep, rank % case.ep)
    raise ValueError(case.model)


def is_lm(case: Case) -> bool:
    return case.model in ("tied", "gpt", "hf", "tp")


# -- config and the client's objects -------------------------------------------------------------
def config(case: Case, world: int, resuming: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": case.micro, "gradient_accumulation_steps": case.accum,
           "steps_per_print": 10 ** 6, "gradient_clipping": case.clip,
           "zero_optimization": {"stage": case.stage}}
    if case.batch:  # DeepSpeed 0.19.8 counts every rank, tensor-parallel ones too
        cfg["train_batch_size"] = case.micro * case.accum * world
    if not case.opt.startswith("client_"):
        cfg["optimizer"] = optimizer_section(case)
    elif case.stage or case.offload != "none":
        cfg["zero_allow_untested_optimizer"] = True
    if case.allow_untested:
        cfg["zero_allow_untested_optimizer"] = True
    sched = scheduler_section(case)
    if sched:
        cfg["scheduler"] = sched
    if case.offload in ("opt", "opt+param"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if case.offload == "opt+param":
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if case.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": case.loss_scale, "initial_scale_power": case.scale_power,
                       "loss_scale_window": case.scale_window, "hysteresis": 1}
    if case.prescale:
        cfg["prescale_gradients"] = True
    if case.predivide != 1.0:
        cfg["gradient_predivide_factor"] = case.predivide
    if case.comm != "none":
        cfg["communication_data_type"] = case.comm
    if case.gad != "none":
        cfg["data_types"] = {"grad_accum_dtype": case.gad}
    if case.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": case.tp}
    if resuming and case.universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def optimizer_section(case: Case) -> dict:
    lr = LR[case.opt]
    if case.opt in ("adam", "adamw"):
        return {"type": "Adam" if case.opt == "adam" else "AdamW", "params": {"lr": lr, "weight_decay": 0.01}}
    if case.opt == "adam_l2":
        return {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.01, "adam_w_mode": False}}
    if case.opt == "torch_adamw":
        return {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}}
    if case.opt == "adagrad":
        return {"type": "Adagrad", "params": {"lr": lr, "weight_decay": 0.01}}
    if case.opt == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}}
    if case.opt == "rmsprop":
        return {"type": "RMSprop", "params": {"lr": lr}}
    if case.opt == "lion":
        return {"type": "Lion", "params": {"lr": lr, "weight_decay": 0.01}}
    if case.opt == "lamb":
        return {"type": "Lamb", "params": {"lr": lr, "weight_decay": 0.01}}
    raise ValueError(case.opt)


def scheduler_section(case: Case) -> Optional[dict]:
    lr = LR[case.opt]
    total = case.steps + 2
    if case.sched == "warmup":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": 3}}
    if case.sched == "decay":
        return {"type": "WarmupDecayLR", "params": {"warmup_max_lr": lr, "warmup_num_steps": 2,
                                                     "total_num_steps": total}}
    if case.sched == "cosine":
        return {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": total}}
    if case.sched == "onecycle":
        return {"type": "OneCycle", "params": {"cycle_min_lr": lr / 10, "cycle_max_lr": lr,
                                               "cycle_first_step_size": 2, "cycle_momentum": False}}
    return None


def client_optimizer(case: Case, params):
    lr = LR[case.opt]
    if case.opt == "client_adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if case.opt == "client_sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return None


def client_scheduler(case: Case):
    if case.sched != "client":
        return None
    return lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


# -- data --------------------------------------------------------------------------------------
def batch(case: Case, step: int, micro: int, dp_rank: int, dtype):
    """Micro-batch `micro` of step `step` for data-parallel rank `dp_rank` (the same for
    every rank of a tensor-parallel group): inputs and targets."""
    g = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * micro + dp_rank)
    if is_lm(case):
        t = torch.randint(0, VOCAB, (case.micro, SEQ + 1), generator=g)
        return t[:, :SEQ], t[:, 1:]
    shape = (case.micro, MOE_TOKENS) if case.model == "moe" else (case.micro,)
    x = torch.randn(*shape, IN, generator=g)
    y = torch.randn(*shape, OUT, generator=g)
    return x.to(dtype), y


def loss_of(case: Case, engine, inputs, targets):
    if case.model in ("hf", "tp"):
        return engine(input_ids=inputs, labels=inputs).loss  # the model shifts the labels itself
    if case.model == "moe":
        y, l_aux = engine(inputs)
        return (y.float() - targets).pow(2).mean() + 0.01 * l_aux.float()
    out = engine(inputs)
    if is_lm(case):
        return F.cross_entropy(out.float().reshape(-1, VOCAB), targets.reshape(-1))
    return (out.float() - targets).pow(2).mean()


def compute_dtype(case: Case):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.dtype, torch.float32)


# -- the run -----------------------------------------------------------------------------------
def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, group=dist.group.WORLD)
        t /= dist.get_world_size()
    return float(t)


class Run:
    """One engine's part of a case: build it (resuming `load` if given) and train steps
    [first, last)."""

    def __init__(self, rt, case: Case):
        self.rt, self.case = rt, case
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.losses: List[float] = []
        self.evals: List[float] = []

    def build(self, resuming: bool = False):
        case = self.case
        model = build_model(self.rt, case, self.rank)
        params = [p for p in model.parameters()]
        opt = client_optimizer(case, params)
        kwargs = {}
        if opt is not None:
            kwargs["optimizer"] = opt
        sched = client_scheduler(case)
        if sched is not None:
            kwargs["lr_scheduler"] = sched
        engine, _, _, _ = self.rt.initialize(model=model, model_parameters=params, config=config(case, self.world, resuming),
                                             **kwargs)
        return engine

    def train(self, engine, first: int, last: int) -> None:
        case = self.case
        dtype = compute_dtype(case)
        dp_rank = self.rank // case.tp
        for step in range(first, last):
            for m in range(case.accum):
                if case.zero_grad == "micro":
                    engine.zero_grad()
                x, y = batch(case, step, m, dp_rank, dtype)
                quiet = case.no_sync and m < case.accum - 1
                with (engine.no_sync() if quiet else _nothing()):
                    loss = loss_of(case, engine, x, y)
                    if case.backward == "engine":
                        engine.backward(loss)
                    elif case.backward == "scale":
                        engine.scale(loss).backward()
                    else:
                        loss.backward()
                engine.step()
                self.losses.append(mean_over_ranks(loss))
            if case.zero_grad == "boundary":
                engine.zero_grad()
            if case.eval and step == 0:
                engine.eval()
                with torch.no_grad():
                    x, y = batch(case, 99, 0, dp_rank, dtype)
                    self.evals.append(mean_over_ranks(loss_of(case, engine, x, y)))
                engine.train()

    def weights(self, engine):
        """(names, sizes, flat fp32 values) of the module's parameters on rank 0, gathered at
        ZeRO-3; Nones under tensor parallelism (each rank holds its shard)."""
        if self.case.tp > 1:
            return None, None, None
        params = list(engine.module.named_parameters())
        ctx = _nothing()
        if self.case.stage == 3:
            ctx = self.rt.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
        with ctx:
            names = [n for n, _ in params]
            sizes = [p.numel() for _, p in params]
            flat = torch.cat([p.detach().float().reshape(-1).cpu() for _, p in params]) if params else torch.zeros(0)
            return names, sizes, [float(v) for v in flat]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_case(rt, case: Case, phase: int, ckpt: str) -> dict:
    """Phase 0 trains from the start (to `save`, then resumes in a fresh engine on the same
    ranks unless the case resumes on another world size); phase 1 resumes `ckpt` on this
    world. Returns rank 0's result."""
    run = Run(rt, case)
    last = case.steps
    if phase == 0:
        engine = run.build()
        stop = case.save or last
        run.train(engine, 0, stop)
        if case.save:
            engine.save_checkpoint(ckpt, tag=f"step{case.save}")
            if len(case.phases) > 1:
                result = {"losses": run.losses, "eval": run.evals}
                _destroy(engine)
                return result
            _destroy(engine)
            engine = resume(rt, run, ckpt)
            run.train(engine, case.save, last)
    else:
        engine = resume(rt, run, ckpt)
        run.train(engine, case.save, last)
    names, sizes, flat = run.weights(engine)
    result = {"losses": run.losses, "eval": run.evals, "global_steps": int(engine.global_steps),
              "skipped_steps": int(engine.skipped_steps), "weight_names": names, "weight_sizes": sizes,
              "weights": flat}
    _destroy(engine)
    return result


def resume(rt, run: Run, ckpt: str):
    """A fresh engine resuming the case's checkpoint; with `universal`, rank 0 first converts it
    with the engine's own `python -m <engine>.checkpoint.ds_to_universal`."""
    case = run.case
    tag = f"step{case.save}"
    if case.universal:
        tag = f"{tag}_universal"
        error = None
        if run.rank == 0 and not os.path.isdir(os.path.join(ckpt, tag)):
            proc = subprocess.run([sys.executable, "-m", f"{rt.__name__}.checkpoint.ds_to_universal",
                                   "--input_folder", os.path.join(ckpt, f"step{case.save}"), "--output_folder",
                                   os.path.join(ckpt, tag), "--num_extract_workers", "1", "--num_merge_workers", "1",
                                   "--inject_missing_state"], capture_output=True, text=True)
            if proc.returncode:
                lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or [f"exit {proc.returncode}"]
                error = f"ds_to_universal: {lines[-1].strip()}"
        failed = torch.tensor([1.0 if error else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(failed, group=dist.group.WORLD)  # every rank learns whether rank 0 converted
        if failed.item():
            raise ConversionError(error or "ds_to_universal failed on rank 0")
    engine = run.build(resuming=True)
    engine.load_checkpoint(ckpt, tag=tag)
    return engine


class ConversionError(RuntimeError):
    """The engine's checkpoint converter stopped (its last line)."""


def _destroy(engine) -> None:
    engine.destroy()
