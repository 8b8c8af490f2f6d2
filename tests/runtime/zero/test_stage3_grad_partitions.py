"""DeepSpeed's stage-3 gradient-partition API (runtime/zero/grad_views.py): after a backward,
`optimizer.averaged_gradients` and `optimizer.get_fp32_grad_partitions()` hold this rank's
averaged gradient partition of each parameter, padding included; further backwards without
a step add to them; the script's `optimizer.zero_grad()` makes the next backward overwrite
them; `engine.allreduce_gradients()` may be called after any backward. The reference is the
gradient of the same model computed by hand in each rank from both ranks' data."""
import torch

from dist_harness import run_function

SHAPES = [(3, 5), (3,), (2, 3)]  # 15 and 3 elements: the last rank's partition is padded


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(*SHAPES[0]))
        self.b = torch.nn.Parameter(torch.randn(*SHAPES[1]))
        self.v = torch.nn.Parameter(torch.randn(*SHAPES[2]))

    def forward(self, x):
        h = torch.tanh(x @ self.w.t() + self.b)
        return (h @ self.v.t()).pow(2).mean()


def _batch(rank, i):
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * i + rank))


def _reference(i, world, rank):
    """Per parameter, this rank's partition of the gradient averaged over both ranks' batches."""
    grads = []
    for r in range(world):
        net = _Net()
        net(_batch(r, i)).backward()
        grads.append([p.grad.reshape(-1) for p in net.parameters()])
    out = []
    for k, p in enumerate(_Net().parameters()):
        mean = sum(g[k] for g in grads) / world
        chunk = -(-p.numel() // world)
        padded = torch.cat([mean, mean.new_zeros(chunk * world - p.numel())])
        out.append(padded[rank * chunk:(rank + 1) * chunk])
    return out


def partitions_body():
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, optimizer, _, _ = deepspeed.initialize(model=_Net(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    seen = {}
    engine.backward(engine(_batch(rank, 0)))
    engine.allreduce_gradients()
    seen["one"] = [t.clone() for t in optimizer.averaged_gradients[0]]
    seen["keys"] = (sorted(optimizer.averaged_gradients), sorted(optimizer.get_fp32_grad_partitions()[0]))
    engine.backward(engine(_batch(rank, 1)))  # no step: the partitions add up
    seen["two"] = [t.clone() for t in optimizer.get_fp32_grad_partitions()[0].values()]
    optimizer.zero_grad()
    seen["kept"] = [t.clone() for t in optimizer.averaged_gradients[0]]  # until the next backward lands
    engine.backward(engine(_batch(rank, 2)))
    seen["restarted"] = [t.clone() for t in optimizer.averaged_gradients[0]]
    engine.step()
    seen["after_step"] = len(optimizer.averaged_gradients)
    seen["summary"] = engine.module.w.ds_summary()
    seen["reference"] = [_reference(i, world, rank) for i in range(3)]
    return seen


def test_averaged_gradient_partitions_accumulate_and_restart_as_deepspeeds():
    for seen in run_function(partitions_body, nprocs=2, timeout=180):
        ref = seen["reference"]
        close = lambda a, b: all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))  # noqa: E731
        assert seen["keys"] == ([0], [0, 1, 2])
        assert [t.numel() for t in seen["one"]] == [8, 2, 3]
        assert close(seen["one"], ref[0])
        assert close(seen["two"], [a + b for a, b in zip(ref[0], ref[1])])
        assert not close(seen["two"], ref[1])  # the sum, not the last backward's alone
        assert close(seen["kept"], seen["two"])
        assert close(seen["restarted"], ref[2])
        assert seen["after_step"] == 0  # the step frees them
        assert seen["summary"]["ds_numel"] == 15 and seen["summary"]["ds_shape"] == (3, 5)
        assert seen["summary"]["status"] == "NOT_AVAILABLE" and seen["summary"]["ds_tensor.shape"] == (8,)


def bf16_partitions_body():
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    engine, optimizer, _, _ = deepspeed.initialize(model=_Net(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.backward(engine(_batch(dist.get_rank(), 0).to(torch.bfloat16)).float())
    stored = list(optimizer.averaged_gradients[0])
    fp32 = list(optimizer.get_fp32_grad_partitions()[0].values())
    return [t.dtype for t in stored], [t.dtype for t in fp32], all(torch.equal(a.float(), b) for a, b in zip(stored, fp32))


def test_fp32_grad_partitions_are_fp32_whatever_the_partitions_dtype():
    """bf16 partitions (data_types.grad_accum_dtype's default: the model dtype) read back through
    get_fp32_grad_partitions() in fp32, as DeepSpeed's (its test_zero.py checks the dtype)."""
    for stored, fp32, equal in run_function(bf16_partitions_body, nprocs=2, timeout=180):
        assert stored == [torch.bfloat16] * 3 and fp32 == [torch.float32] * 3 and equal


def stage1_allreduce_body():
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    losses = {}
    for early in (False, True):
        engine, _, _, _ = deepspeed.initialize(model=_Net(), config={
            "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 1}})
        out = []
        for i in range(3):
            loss = engine(_batch(rank, i))
            engine.backward(loss)
            if early:
                engine.allreduce_gradients()
            engine.step()
            out.append(loss.item())
        losses[early] = (out, [p.detach().clone() for p in engine.module.parameters()])
    return losses


def test_allreduce_gradients_at_stage_1_reduces_once_and_the_step_is_unchanged():
    for losses in run_function(stage1_allreduce_body, nprocs=2, timeout=180):
        assert losses[True][0] == losses[False][0]
        assert all(torch.equal(a, b) for a, b in zip(losses[True][1], losses[False][1]))
