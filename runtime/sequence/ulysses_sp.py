"""Ulysses sequence parallelism for Hugging Face models, under DeepSpeed's names.

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=2,
                                                          micro_batch_size=1, seq_length=64,
                                                          seq_length_is_variable=False)
    engine, *_ = deepspeed.initialize(model=model, mpu=mpu, config=...)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(),
                                    sp_group=mpu.get_sequence_parallel_group(),
                                    sp_world_size=mpu.get_sequence_parallel_world_size(), device=...)
    for batch in dl:                       # this rank's slice of every sequence
        out = engine(**batch)              # batch has shift_labels: the labels shifted before slicing
        loss = sequence_parallel_loss(out.loss, batch["shift_labels"], mpu.get_sequence_parallel_group())

- register_with_transformers builds the mesh's sequence axis over the world, registers an
  attention function "ulysses" with transformers that wraps the core implementation (sdpa
  or flash attention: ones that make a missing mask causal over the whole sequence) between
  the two all-to-alls, points the model at it, and returns the mpu for initialize.
- UlyssesSPDataLoaderAdapter: the sequence ranks each draw a batch; the batches are gathered
  over the sequence group and handed out one after another, each cut to this rank's slice of
  the sequence, with `shift_labels` (labels shifted left over the whole sequence, so a
  slice's last token is labelled with the next slice's first) and `position_ids`.
- sequence_parallel_loss: the mean over the whole sequence from each rank's mean over its
  tokens, weighted by their counts, differentiable.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch

from ..core import comm
from ..core.parallel import MeshDims, MeshError, ProcessMesh, topology_for
from . import SequenceParallelError, head_splits, heads_to_sequence, sequence_to_heads
from .heads import local_length
from .tiled import (SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute,  # noqa: F401
                    tiled_causal_lm_loss)

# core implementations that attend causally over the whole sequence when given no mask
CORE = ("sdpa", "flash_attention_2", "flash_attention_3")
NAME = "ulysses"


class SequenceParallelMpu:
    """The groups of a data x sequence mesh through DeepSpeed's mpu getters (what
    initialize(mpu=...) reads; the engine averages gradients over data x sequence)."""

    def __init__(self, mesh: ProcessMesh):
        self.mesh = mesh

    def _get(self, axis):
        return self.mesh.group(axis), self.mesh.size(axis), self.mesh.rank(axis)

    def get_sequence_parallel_group(self):
        return self.mesh.group("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size("sequence")

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.rank("sequence")

    def get_sequence_data_parallel_group(self):
        return self.mesh.group("data_sequence")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.size("data_sequence")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.rank("data_sequence")

    def get_data_parallel_group(self):
        return self.mesh.group("data")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("data")

    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank("data")

    # no tensor or pipeline slicing: a model-parallel group of one
    def get_model_parallel_group(self):
        return self.mesh.group("tensor")

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


class UlyssesSPAttentionHF(torch.nn.Module):
    """The attention function registered as "ulysses": HF's [b, h, s/p, d] q, k, v ->
    [b, h_r, s, d] -> the core attention -> [b, s, h_r, d] -> [b, s/p, h, d]."""

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: Optional[int] = None, global_seq_length: Optional[int] = None,
                 disable_in_eval: bool = False, max_length: Optional[int] = None):
        # DeepSpeed's constructor. DeepSpeed sizes buffers from the shapes (and rotates them
        # over num_hidden_layers); here they are checked against each call's tensors when the
        # length is fixed (seq_length_is_variable False), max_length bounds a variable one, and
        # a layer index at or past num_hidden_layers is refused. disable_in_eval: in eval mode
        # the model sees whole sequences, so the core attention runs unwrapped.
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.batch_size, self.head_size, self.num_layers = batch_size, attn_head_size, num_hidden_layers
        self.num_heads, self.num_kv_heads = attn_head_count, kv_head_count
        self.seq_length, self.seq_length_is_variable = global_seq_length, seq_length_is_variable
        self.local_seq_length, self.max_length = local_seq_length, max_length
        self.disable_in_eval = disable_in_eval

    def _check(self, module, query, key, sp: int) -> None:
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, int) and self.num_layers is not None and layer >= self.num_layers:
            raise SequenceParallelError(f"ulysses: attention layer {layer} is past the num_hidden_layers "
                                        f"{self.num_layers} given to register_with_transformers")
        length = query.shape[2] * sp
        if self.max_length is not None and length > self.max_length:
            raise SequenceParallelError(f"ulysses: sequence length {length} exceeds max_length {self.max_length}")
        if self.seq_length_is_variable:
            return
        want = {"sequence length": (length, self.seq_length), "batch size": (query.shape[0], self.batch_size),
                "head size": (query.shape[-1], self.head_size), "head count": (query.shape[1], self.num_heads),
                "key/value head count": (key.shape[1], self.num_kv_heads)}
        for what, (got, expected) in want.items():
            if expected is not None and got != expected:
                raise SequenceParallelError(f"ulysses: {what} {got} differs from the {expected} given to "
                                            "register_with_transformers")

    def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        sp = comm.get_world_size(self.process_group)
        self._check(module, query, key, sp)
        kv = key.shape[1]
        q = sequence_to_heads(query, self.process_group, seq_dim=2, head_dim=1, kv_heads=kv)
        k = sequence_to_heads(key, self.process_group, seq_dim=2, head_dim=1, kv_heads=kv)
        v = sequence_to_heads(value, self.process_group, seq_dim=2, head_dim=1, kv_heads=kv)
        # the model's mask covers this rank's slice only: the core attends causally over the
        # whole sequence instead (it makes a missing mask causal)
        out, _ = self.attn(module, q, k, v, None, *args, **kwargs)
        return heads_to_sequence(out, self.process_group, seq_dim=1, total_heads=query.shape[1], head_dim=2,
                                 kv_heads=kv), None

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: Optional[int] = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False, max_length: Optional[int] = None):
        """Build the sequence groups, register "ulysses" with transformers around
        `core_attn_implementation`, point the model (an instance, or later loads of a name
        or path with attn_implementation="ulysses") at it; return the mpu."""
        from transformers import AttentionInterface, AutoConfig, PreTrainedModel

        if core_attn_implementation not in CORE:
            raise SequenceParallelError(f"ulysses: core_attn_implementation {core_attn_implementation!r} cannot be "
                                        f"wrapped (it needs the model's mask for causality); use one of "
                                        f"{', '.join(CORE)}")
        core = AttentionInterface._global_mapping.get(core_attn_implementation)
        if core is None:
            raise SequenceParallelError(f"ulysses: transformers has no attention {core_attn_implementation!r}")
        if isinstance(model_name_or_path, PreTrainedModel):
            model, config = model_name_or_path, model_name_or_path.config
        else:
            model, config = None, AutoConfig.from_pretrained(model_name_or_path)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        sp = int(sequence_parallel_size)
        if not comm.is_initialized():
            comm.init_distributed()
        try:
            dims = MeshDims.for_world(comm.get_world_size(), sequence=sp)
        except MeshError as exc:
            raise SequenceParallelError(f"ulysses: {exc}") from None
        head_splits(heads, sp, kv)  # fewer key/value heads than ranks: one line
        if seq_length is not None and not seq_length_is_variable:
            local_length(int(seq_length), sp)
        mesh = ProcessMesh(topology_for(dims))
        head_size = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
        wrapper = cls(core, batch_size=int(micro_batch_size), attn_head_count=heads, attn_head_size=head_size,
                      kv_head_count=kv, num_hidden_layers=int(config.num_hidden_layers),
                      process_group=mesh.group("sequence"), seq_length_is_variable=seq_length_is_variable,
                      local_seq_length=None if seq_length is None else int(seq_length) // sp,
                      global_seq_length=seq_length, disable_in_eval=disable_in_eval, max_length=max_length)
        AttentionInterface.register(NAME, wrapper)
        if model is not None:
            model.config._attn_implementation = NAME
        return SequenceParallelMpu(mesh)


class UlyssesSPDataLoaderAdapter:
    """Batches (dicts of [b, s] tensors) cut along the sequence for this rank. The sequence
    ranks draw one batch each; the sp batches are gathered over `sp_group` and each of them
    is handed out in turn, so the group trains on every batch drawn (len = sp x len(dl))."""

    def __init__(self, dl: Iterable, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = device
        self._it = None
        self._pending = []

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        self._it = iter(self.dl)
        self._pending = []
        return self

    def __next__(self) -> Dict[str, Any]:
        if self._it is None:
            iter(self)
        if not self._pending:
            self._refill()
        return self._shard(self._pending.pop(0))

    def _refill(self) -> None:
        batch = next(self._it)  # StopIteration ends every rank's epoch together (same lengths)
        gathered = [None] * self.sp_world_size
        comm.all_gather_object(gathered, {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()},
                               group=self.sp_group, label="ulysses batches")
        self._pending = gathered

    def _shard(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        ids = batch["input_ids"]
        total = ids.shape[-1]
        chunk = local_length(total, self.sp_world_size)
        batch = dict(batch)
        if "labels" in batch and "shift_labels" not in batch:
            labels = batch["labels"]
            batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(total).unsqueeze(0).expand(ids.shape[0], total)
        batch.pop("attention_mask", None)  # causal over the whole sequence (see UlyssesSPAttentionHF)
        lo = self.sp_rank * chunk
        out = {}
        for k, v in batch.items():
            if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == total:
                v = v[:, lo:lo + chunk].contiguous()
            out[k] = v.to(self.device) if torch.is_tensor(v) else v
        return out


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; each output depends on every input, so the gradient sums too."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone()
        comm.all_reduce(out, group=group, label="ulysses loss")
        return out

    @staticmethod
    def backward(ctx, grad):
        g = grad.clone()
        comm.all_reduce(g, group=ctx.group, label="ulysses loss backward")
        return g, None


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group, ignore_index: int = -100):
    """The mean loss over the whole sequence, from this rank's mean over its labelled tokens
    (`loss`, 0 tokens allowed) and its `shift_labels`: sum(loss_r x n_r) / sum(n_r) over the
    sequence group. Differentiable; the engine's average over data x sequence then gives
    one process's gradients."""
    n = (shift_labels != ignore_index).sum().to(loss.dtype)
    local = torch.where(n > 0, loss * n, torch.zeros_like(loss))
    both = _AllReduceSum.apply(torch.stack([local, n]), group)
    return both[0] / both[1].clamp(min=1)
