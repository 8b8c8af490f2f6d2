"""deepspeed.checkpointing: a model with dropout, checkpointed, equals the same model
unchecked step by step (dropout draws the same numbers on recompute, also under the RNG
tracker's fork), with less activation memory kept for backward; the config section
reaches the API through initialize(); partition_activations splits the kept inputs across
the model-parallel group and contiguous_memory_optimization packs them in one buffer."""
import copy

import pytest
import torch

from dist_harness import run_function

import dslaunch.runtime as deepspeed
from dslaunch.runtime.activation_checkpointing import checkpointing


class Block(torch.nn.Module):
    def __init__(self, dim, tracker=False):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.drop = torch.nn.Dropout(0.3)
        self.tracker = tracker

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.tracker:  # Megatron's model-parallel dropout draws from the tracker's state
            with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        return x + self.fc2(h)


class Net(torch.nn.Module):
    def __init__(self, dim=32, depth=4, checkpointed=False, tracker=False):
        super().__init__()
        self.inp = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, tracker) for _ in range(depth))
        self.out = torch.nn.Linear(dim, 1)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = deepspeed.checkpointing.checkpoint(b, h) if self.checkpointed else b(h)
        return self.out(h)


class SavedBytes:
    """Bytes autograd keeps for backward during a forward (each storage once): the
    activation memory that checkpointing is meant to lower."""

    def __init__(self):
        self.seen, self.total = set(), 0

    def pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in self.seen and not isinstance(t, torch.nn.Parameter):
            self.seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _run(model, steps, seed_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seed_fn()
    losses, kept = [], []
    for step in range(steps):
        x = torch.randn(64, 8)
        with SavedBytes() as saved:
            loss = model(x).pow(2).mean()
        kept.append(saved.total)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, kept


@pytest.mark.parametrize("tracker", [False, True])
def test_checkpointed_equals_unchecked_step_by_step_with_less_activation_memory(tracker):
    deepspeed.checkpointing.configure(None)

    def seed():
        torch.manual_seed(7)
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(1234)

    torch.manual_seed(0)
    plain = Net(tracker=tracker)
    ckpt = copy.deepcopy(plain)
    ckpt.checkpointed = True
    plain_losses, plain_kept = _run(plain, 4, seed)
    ckpt_losses, ckpt_kept = _run(ckpt, 4, seed)
    assert plain_losses == ckpt_losses  # bit for bit: the same dropout masks on recompute
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(a, b)
    assert max(ckpt_kept) < 0.35 * min(plain_kept), (ckpt_kept, plain_kept)


def test_rng_tracker_and_model_parallel_seed_on_cpu():
    class Mpu:
        def get_model_parallel_rank(self):
            return 1

    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(5, mpu=Mpu())
    a = torch.rand(3)  # the default (CPU) generator got seed 5
    torch.manual_seed(5)
    assert torch.equal(a, torch.rand(3))
    with tracker.fork():
        b = torch.rand(3)
    torch.manual_seed(5 + 2718 + 1)  # model-parallel state: seed + 2718 + tensor-parallel rank
    assert torch.equal(b, torch.rand(3))
    with pytest.raises(ValueError, match="state 'other' was never added"):
        with tracker.fork("other"):
            pass


class _WorldMpu:
    """Model parallelism over the whole (2-rank) world, data parallel size 1."""

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size()

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank()


def _partition_worker():
    import io
    from contextlib import redirect_stdout

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                        "number_checkpoints": 4, "cpu_checkpointing": True,
                                        "synchronize_checkpoint_boundary": True, "profile": True}}
    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(model=Net(checkpointed=True), config=cfg,
                                           model_parameters=None)
    s = checkpointing.state
    from_engine = (checkpointing.is_configured(), s.partition_activations, s.cpu_checkpointing, s.profile,
                   s.number_checkpoints)
    buf = io.StringIO()
    with redirect_stdout(buf):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()

    # The script's configure() with an mpu: inputs split across the 2 model-parallel ranks.
    deepspeed.checkpointing.configure(_WorldMpu(), deepspeed_config=cfg, profile=False)
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Net(checkpointed=checkpointed)
        torch.manual_seed(1)  # the same input on both ranks, as in a model-parallel region
        x = torch.randn(64, 8)
        with SavedBytes() as saved:
            loss = model(x).pow(2).mean()
        loss.backward()
        results[checkpointed] = (loss.item(), [p.grad.clone() for p in model.parameters()], saved.total)
    slots = checkpointing.state.slots
    same = results[False][0] == results[True][0] and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(results[False][1], results[True][1]))
    return {"from_engine": from_engine, "profile_lines": buf.getvalue().count("activation checkpoint"),
            "same": same, "kept": (results[False][2], results[True][2]),
            "slots": (sorted(tuple(b.shape) for b in slots.buffers.values()), slots.used, slots.open)}


def test_config_section_partition_and_contiguous_on_two_ranks():
    out = run_function(_partition_worker, nprocs=2, timeout=180)
    for rank, r in enumerate(out):
        assert r["from_engine"] == (True, True, True, True, 4)
        assert r["same"]
        plain, ckpt = r["kept"]
        assert ckpt < 0.2 * plain, r["kept"]
        # 4 checkpoints x half of a 64x32 activation per rank, slots free again after backward
        assert r["slots"] == ([(4, 64 * 32 // 2)], 0, 0)
    assert out[0]["profile_lines"] == 8 and out[1]["profile_lines"] == 0  # forward + backward per block, rank 0


@pytest.mark.gpu
def test_peak_cuda_memory_lower_when_checkpointed():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    deepspeed.checkpointing.configure(None)
    peaks = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Net(dim=256, depth=8, checkpointed=checkpointed).cuda()
        x = torch.randn(512, 8, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        peaks[checkpointed] = torch.cuda.max_memory_allocated() - base
    assert peaks[True] < 0.6 * peaks[False], peaks
