"""DeepSpeed's methods on a ZeRO-3 parameter, called on one parameter for a list as DeepSpeed's
own tests and scripts do: `params[0].all_gather_coalesced(params)` returns a handle whose wait()
leaves them whole and AVAILABLE; `p.all_gather()` gathers one; `p.partition()` frees the whole
copy again, and `partition(has_been_updated=True)` first cuts each rank's shard from a value
written while whole. The reference is the model built in one process from the same seed."""
import torch

from dist_harness import run_function


def methods_body():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero import ZeroParamStatus

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    params = list(net.parameters())
    out = {"rest": [p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params]}
    handle = params[0].all_gather_coalesced(params)
    handle.wait()
    out["coalesced"] = [p.detach().clone() for p in params]
    out["available"] = [p.ds_status == ZeroParamStatus.AVAILABLE for p in params]
    params[0].partition(params)
    out["released"] = [p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params]
    w = params[0]
    w.all_gather()
    with torch.no_grad():
        w.mul_(2)
    w.partition(has_been_updated=True)
    out["others_untouched"] = params[1].numel() == 0
    with deepspeed.zero.GatheredParameters(params):
        out["after_update"] = [p.detach().clone() for p in params]
    return out


def test_deepspeeds_param_methods_gather_and_partition():
    torch.manual_seed(0)
    reference = [p.detach() for p in torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).parameters()]
    for got in run_function(methods_body, nprocs=2, timeout=180):
        assert all(got["rest"]) and all(got["available"]) and all(got["released"]) and got["others_untouched"]
        for want, have in zip(reference, got["coalesced"]):
            assert torch.equal(want, have)
        assert torch.equal(got["after_update"][0], reference[0] * 2)
        for want, have in zip(reference[1:], got["after_update"][1:]):
            assert torch.equal(want, have)
