"""DeepSpeed's public API as users import it (tests/data/deepspeed_api.json, written by
scripts/deepspeed_api_surface.py against DeepSpeed 0.19.8): the table is true of the
compatibility package, the docs page is the table's, and the important entries behave as
DeepSpeed's documentation calls them."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = repo_paths.ROOT
TABLE = json.loads((ROOT / "tests" / "data" / "deepspeed_api.json").read_text())


def _surface():
    return load_script("deepspeed_api_surface")


def test_every_row_is_what_the_package_does(deepspeed_compat):
    """Re-probe every name under the installed compatibility package: a row marked provided
    resolves and accepts DeepSpeed's arguments, and a row marked missing is still missing
    (so adding a name means regenerating the table)."""
    surface = _surface()
    names = [e["name"] for e in TABLE["entries"]]
    env = dict(os.environ, PYTHONPATH=str(deepspeed_compat.target), CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "api_probe.py")],
                         input=json.dumps({"names": names}), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ours = json.loads(res.stdout)["names"]
    wrong = []
    for e in TABLE["entries"]:
        status, _ = surface.status_of(e["name"], {"kind": e["kind"], "params": e["params"]}, ours[e["name"]])
        if status != e["status"]:
            wrong.append(f"{e['name']}: table says {e['status']}, the package gives {status}")
    assert not wrong, "\n".join(wrong)
    assert all(e["note"] for e in TABLE["entries"] if e["status"] in ("refused", "differs"))


def test_docs_page_is_the_table():
    assert (ROOT / "docs" / "deepspeed-api.md").read_text() == _surface().render(TABLE)


def test_signature_rule():
    compatible = _surface().compatible
    ds = [["a", "POSITIONAL_OR_KEYWORD", False], ["b", "POSITIONAL_OR_KEYWORD", True]]
    assert compatible(ds, [["a", "POSITIONAL_OR_KEYWORD", False], ["b", "POSITIONAL_OR_KEYWORD", True]]) is None
    assert compatible(ds, [["a", "POSITIONAL_OR_KEYWORD", False]]) == "no parameter 'b'"
    assert compatible(ds, [["b", "POSITIONAL_OR_KEYWORD", True], ["a", "POSITIONAL_OR_KEYWORD", True]]).startswith(
        "positional parameter 0")
    assert compatible(ds, [["a", "POSITIONAL_OR_KEYWORD", False], ["c", "KEYWORD_ONLY", False],
                           ["kw", "VAR_KEYWORD", False]]) == "ours requires 'c', which DeepSpeed's callers do not pass"
    assert compatible([["args", "VAR_POSITIONAL", False], ["kwargs", "VAR_KEYWORD", False]], []) is None


# -- behaviour -----------------------------------------------------------------------------------

def test_dynamic_loss_scaler_follows_deepspeed():
    from dslaunch.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler

    s = DynamicLossScaler(init_scale=2 ** 8, scale_window=2, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    scales = []
    for overflow in [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]:
        s.update_scale(bool(overflow))
        scales.append(s.cur_scale)
    # DeepSpeed 0.19.8's DynamicLossScaler(256, 2, 1, 2, False) given the same overflow flags
    assert scales == [256, 256, 512, 512, 512, 512, 1024, 1024, 1024, 512, 512, 512, 1024, 1024, 2048, 2048, 4096]
    assert (s.cur_iter, s.last_overflow_iter) == (17, 9)
    static = CreateLossScaler(dtype=None, static_loss_scale=128, dynamic_scaling=False, dynamic_loss_args=None)
    assert static.loss_scale == 1.0 and not static.dynamic


def test_deepspeed_config_from_a_path_resolves_batch_sizes(tmp_path):
    from dslaunch.runtime import DeepSpeedConfig, ConfigError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
                                "zero_optimization": {"stage": 2}}))
    cfg = DeepSpeedConfig(str(path))
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (12, 4, 3)
    assert cfg.zero_optimization.stage == 2

    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    assert DeepSpeedConfig({"train_batch_size": 16, "gradient_accumulation_steps": 2}, mpu=Mpu()) \
        .train_micro_batch_size_per_gpu == 4
    with pytest.raises(ConfigError, match="zero_optimization.stagee"):
        DeepSpeedConfig({"zero_optimization": {"stagee": 2}})


def test_configure_train_batch_size_fills_and_checks_against_the_world_size():
    # DeepSpeed's TestBatchConfig drives this: set the three keys, re-resolve, expect an
    # AssertionError where they do not fit the data-parallel size
    from dslaunch.runtime import DeepSpeedConfig, ConfigError

    class Mpu:
        def get_data_parallel_world_size(self):
            return 2

    cfg = DeepSpeedConfig({"train_batch_size": 2}, mpu=Mpu())
    assert cfg.world_size == 2
    for given, want in [((32, 16, 1), (32, 16, 1)), ((32, 16, None), (32, 16, 1)), ((32, None, 2), (32, 8, 2)),
                        ((None, 8, 2), (32, 8, 2)), ((None, 16, None), (32, 16, 1)), ((32, None, None), (32, 16, 1))]:
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = given
        cfg._configure_train_batch_size()
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == want
    for given in [(33, 17, 2), (33, 17, None), (None, None, 2), (32, 18, 1)]:
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = given
        with pytest.raises(AssertionError, match="batch size: ") as err:
            cfg._configure_train_batch_size()
        assert isinstance(err.value, ConfigError)
        assert given[:2] == (None, None) or "data-parallel size 2 (mpu)" in str(err.value)
    assert DeepSpeedConfig({"zero_optimization": {"stage": 1}}).world_size == 1  # no process group


def test_see_memory_usage_prints_only_when_forced():
    code = ("from dslaunch.runtime.utils import see_memory_usage\n"
            "see_memory_usage('quiet')\nsee_memory_usage('after init', force=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "after init" and "quiet" not in out
    assert lines[1].startswith("MA ") and lines[2].startswith("CPU Virtual Memory:  used = ")


def test_move_to_device_and_accelerator_calls():
    import torch

    from dslaunch.runtime.accelerator import get_accelerator, is_current_accelerator_supported
    from dslaunch.runtime.utils import move_to_device

    t = torch.ones(2)
    moved = move_to_device({"a": [t, 3], "b": (t,)}, "cpu", lambda x: torch.is_tensor(x))
    assert moved["a"][0] is t and moved["a"][1] == 3 and moved["b"][0] is t
    acc = get_accelerator()
    assert is_current_accelerator_supported()
    x = acc.LongTensor([1, 2])
    assert x.dtype == torch.int64 and acc.on_accelerator(x) == (acc.device_name() == "cpu")
    state = acc.get_rng_state()
    a = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated() // 2
    acc.manual_seed(3)
    assert acc.initial_seed() == 3


def test_clip_grad_norm_matches_torch_in_one_process():
    import torch

    from dslaunch.runtime.utils import clip_grad_norm_

    torch.manual_seed(0)
    x = torch.randn(5, 4) * 10
    for norm_type in (2.0, 1.0, float("inf")):
        a = torch.nn.Linear(4, 3)
        b = torch.nn.Linear(4, 3)
        b.load_state_dict(a.state_dict())
        a(x).sum().backward()
        b(x).sum().backward()
        ours = clip_grad_norm_(list(a.parameters()), 0.5, norm_type=norm_type)
        ref = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 0.5, norm_type=norm_type)
        assert torch.allclose(ours, ref, rtol=1e-5)
        assert torch.allclose(a.weight.grad, b.weight.grad, rtol=1e-5, atol=1e-7)


def comm_and_zero_body():
    """Two ranks: deepspeed.comm's list and coalesced collectives, batched p2p, and
    zero.Init(remote_device="cpu", pin_memory=..., config_dict_or_path=...) with
    GatheredParameters(modifier_rank=0) writing back."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm

    deepspeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    group = comm.new_group([0, 1])
    out = {}
    ins = [torch.full((2,), float(10 * rank + j)) for j in range(world)]
    outs = [torch.empty(2) for _ in range(world)]
    comm.all_to_all(outs, ins, group=group)
    out["all_to_all"] = [o[0].item() for o in outs]
    single = torch.empty(4)
    comm.all_to_all_single(single, torch.arange(4.0) + 100 * rank, group=comm.get_world_group())
    out["all_to_all_single"] = single.tolist()
    tensors = [torch.full((2,), float(rank + 1)), torch.full((3,), float(rank + 2))]
    comm.all_reduce_coalesced(tensors, group=group)
    out["all_reduce_coalesced"] = [t.tolist() for t in tensors]
    gathered = [[torch.empty(1) for _ in range(world)], [torch.empty(2) for _ in range(world)]]
    comm.all_gather_coalesced(gathered, [torch.tensor([float(rank)]), torch.tensor([rank + 0.5, rank + 0.25])],
                              group=group)
    out["all_gather_coalesced"] = [[t.tolist() for t in g] for g in gathered]
    send, recv = torch.full((3,), float(rank)), torch.empty(3)
    peer = 1 - rank
    works = comm.batch_isend_irecv([comm.P2POp(comm.isend, send, peer, group), comm.P2POp(comm.irecv, recv, peer, group)])
    for w in works:
        w.wait()
    out["p2p"] = recv.tolist()
    comm.barrier(group=group)

    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=cfg):
        model = torch.nn.Linear(4, 4)
    out["partitioned"] = tuple(model.weight.shape) == (0,) or model.weight.numel() < 16
    with deepspeed.zero.GatheredParameters([model.weight], modifier_rank=0):
        if rank == 0:
            model.weight.data.fill_(2.0)
    with deepspeed.zero.GatheredParameters([model.weight]):
        out["written_back"] = model.weight.detach().clone().flatten().tolist()

    from dslaunch.runtime.utils import PartitionedTensor

    whole = torch.arange(15.0).view(3, 5)
    part = PartitionedTensor(whole, group)
    again = PartitionedTensor.from_meta(part.to_meta(), part.data(), group)
    out["partitioned_tensor"] = (part.local_size()[0], torch.equal(again.full(), whole))

    from dslaunch.runtime.utils import groups

    engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out["groups"] = (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank(),
                     groups._get_data_parallel_world_size(), groups._get_sequence_data_parallel_world_size(),
                     comm.get_world_size(groups._get_sequence_parallel_group()))
    return out


def test_comm_collectives_and_zero_init_as_documented():
    r0, r1 = run_function(comm_and_zero_body, nprocs=2, timeout=120)
    assert r0["all_to_all"] == [0.0, 10.0] and r1["all_to_all"] == [1.0, 11.0]
    assert r0["all_to_all_single"] == [0.0, 1.0, 100.0, 101.0] and r1["all_to_all_single"] == [2.0, 3.0, 102.0, 103.0]
    assert r0["all_reduce_coalesced"] == r1["all_reduce_coalesced"] == [[3.0, 3.0], [5.0, 5.0, 5.0]]
    assert r0["all_gather_coalesced"] == r1["all_gather_coalesced"] == [[[0.0], [1.0]], [[0.5, 0.25], [1.5, 1.25]]]
    assert r0["p2p"] == [1.0] * 3 and r1["p2p"] == [0.0] * 3
    assert r0["partitioned"] and r1["partitioned"]
    assert r0["written_back"] == r1["written_back"] == [2.0] * 16
    assert r0["partitioned_tensor"] == (8, True) and r1["partitioned_tensor"] == (7, True)
    assert r0["groups"] == (2, 0, 1, 2, 2) and r1["groups"] == (2, 1, 1, 2, 2)


def test_groups_before_an_engine_and_deepspeeds_expert_layout(monkeypatch):
    from dslaunch.runtime.parallel import current
    from dslaunch.runtime.utils import groups

    monkeypatch.setattr(current, "_mesh", None)  # as in a process that has built no engine

    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    with pytest.raises(groups.GroupsError, match="no engine has been built yet; call deepspeed.initialize"):
        groups._get_data_parallel_group()
    # DeepSpeed 0.19.8's _get_expert_parallel_ranks gives these for the same arguments
    assert groups._get_expert_parallel_ranks(8, 2, 2) == (
        [[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    assert groups._get_expert_parallel_ranks(16, 2, 2, 2)[0][4:] == [[8, 10], [12, 14], [9, 11], [13, 15]]


def test_op_builders_answer_for_our_kernels():
    import torch

    from dslaunch.runtime.ops.op_builder import (AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder,
                                                 UtilsBuilder)

    assert CPUAdamBuilder().is_compatible() and CPUAdamBuilder().load().__name__ == "dslaunch.kernels.cpu_adam"
    # FusedAdam runs everywhere: the CUDA op with a GPU, the CPU Adam op steps its CPU parameters without one
    assert FusedAdamBuilder().is_compatible()
    assert not FusedLambBuilder().is_compatible() and not AsyncIOBuilder().is_compatible()
    with pytest.raises(RuntimeError, match="FusedLambBuilder: the fused_lamb op cannot run here"):
        FusedLambBuilder().load()
    utils = UtilsBuilder().load()
    flat = utils.flatten([torch.ones(2), torch.zeros(3)])
    assert flat.tolist() == [1, 1, 0, 0, 0] and [t.numel() for t in utils.unflatten(flat, [torch.ones(2),
                                                                                          torch.zeros(3)])] == [2, 3]
    t = torch.arange(6, dtype=torch.float16)
    b = utils.cast_to_byte_tensor(t)
    assert b.dtype == torch.uint8 and b.numel() == 12 and b.data_ptr() == t.data_ptr()
    assert [x.numel() for x in utils.cast_to_byte_tensor([t, torch.ones(3, dtype=torch.int64)])] == [12, 24]


def test_partition_uniform_is_deepspeeds():
    from dslaunch.runtime.utils import partition_uniform

    assert partition_uniform(15, 2) == [0, 8, 15]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def test_zero_init_refuses_what_it_cannot_do():
    from dslaunch.runtime import ConfigError, zero

    with pytest.raises(ConfigError, match=r"zero.Init\(param_swapper=...\): not supported"):
        zero.Init(param_swapper=object())
    with pytest.raises(ConfigError, match=r"remote_device='disk'"):
        zero.Init(remote_device="disk")


def test_initialize_mesh_param_is_checked():
    from dslaunch.runtime import ConfigError, _check_mesh_param

    _check_mesh_param(None)
    _check_mesh_param((1, 1))
    with pytest.raises(ConfigError, match=r"mesh_param=\(2, 2\): 2 x 2 is not the world size 1"):
        _check_mesh_param((2, 2))
    with pytest.raises(ConfigError, match="expected \\(data_parallel_size, sequence_parallel_size\\)"):
        _check_mesh_param("dp")


def test_utils_helpers_through_the_package(deepspeed_compat):
    code = """
import logging, torch
from deepspeed.utils import recursive_getattr, recursive_setattr, log_dist_once, set_log_level_from_string, logger
m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
assert recursive_getattr(m, "1.0").__class__.__name__ == "ReLU"
recursive_setattr(m, "1.0", torch.nn.Tanh())
assert isinstance(m[1][0], torch.nn.Tanh)
set_log_level_from_string("info")
assert logger.level == logging.INFO
logging.basicConfig(level=logging.INFO, format="%(message)s")
for _ in range(3):
    log_dist_once("hello once")
"""
    res = subprocess.run([sys.executable, "-c", code], env=deepspeed_compat.env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count("hello once") == 1


def test_deepspeeds_unit_test_imports_answer_truthfully():
    """The names DeepSpeed's own unit tests import (scripts/run_deepspeed_tests.py)."""
    import torch

    import dslaunch.runtime.ops as ops
    from dslaunch.runtime.fp16.fused_optimizer import FP16_Optimizer
    from dslaunch.runtime.ops.op_builder import ALL_OPS
    from dslaunch.runtime.pipe.schedule import TrainSchedule
    from dslaunch.runtime.precision_config import get_bfloat16_config
    from dslaunch.runtime.topology import PipelineParallelGrid, _prime_factors
    from dslaunch.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # probed once from the builders, as DeepSpeed probes on first access
    assert ops.__compatible_ops__ == {name: b.is_compatible() for name, b in ALL_OPS.items()}
    assert ops.__compatible_ops__["cpu_adam"] and not ops.__compatible_ops__["async_io"]
    # DeepSpeed's optimizer wrappers: nothing here is one, and none is built
    assert not isinstance(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), DeepSpeedZeroOptimizer)
    with pytest.raises(TypeError, match="FP16_Optimizer is DeepSpeed's internal optimizer wrapper.*\"fp16\""):
        FP16_Optimizer(None)
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled
    assert [_prime_factors(n) for n in (1, 12, 13)] == [[], [2, 2, 3], [13]]
    with pytest.raises(ValueError):
        _prime_factors(0)
    assert PipelineParallelGrid.__module__ == "dslaunch.runtime.core.parallel.mesh"
    s = TrainSchedule(micro_batches=4, stages=2, stage_id=1)
    assert (s.stage, s.num_stages, s.num_micro_batches) == (1, 2, 4)
    spec = importlib.util.spec_from_file_location("numa", ROOT / "compat/deepspeed/deepspeed/utils/numa.py")
    numa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(numa)
    assert numa.parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2"):
        with pytest.raises(ValueError):
            numa.parse_range_list(bad)
    spec = importlib.util.spec_from_file_location("runner", ROOT / "compat/deepspeed/deepspeed/launcher/runner.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert runner._parse_hostfile(["w1 slots=2", "", "# c", "10.0.0.2 slots=1"]) == {"w1": 2, "10.0.0.2": 1}
    with pytest.raises(ValueError, match="duplicate host"):
        runner._parse_hostfile(["w1 slots=2", "w1 slots=1"])
    hosts = {"w0": [0, 1, 2, 3], "w1": [0, 1, 2, 3]}
    assert runner.parse_resource_filter(hosts, exclude_str="w0:0,1@w1:3") == {"w0": [2, 3], "w1": [0, 1, 2]}
    assert runner.parse_resource_filter(hosts, include_str="w1:0,3") == {"w1": [0, 3]}
    assert runner.parse_resource_filter({"w0": [0, 1]}, exclude_str="w0") == {}  # DeepSpeed's answer
    for bad in ({"include_str": "A", "exclude_str": "B"}, {"include_str": "jeff"}, {"exclude_str": "w1:4"}):
        with pytest.raises(ValueError):
            runner.parse_resource_filter(hosts, **bad)


REFUSED_MODULES = '''
import importlib, json
out = {}
for name in ("deepspeed.runtime.fp16.onebit.adam", "deepspeed.runtime.fp16.onebit.lamb",
             "deepspeed.launcher.multinode_runner"):
    try:
        importlib.import_module(name)
        out[name] = None
    except ImportError as exc:
        out[name] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
'''


def test_modules_dslaunch_lacks_refuse_in_one_line(deepspeed_compat):
    """DeepSpeed's 1-bit optimizers and its launcher's command builders: importing them is an
    ImportError naming what is missing and what to use instead (not a bare ModuleNotFoundError)."""
    res = subprocess.run([sys.executable, "-c", REFUSED_MODULES], env=deepspeed_compat.env(), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    for name in ("deepspeed.runtime.fp16.onebit.adam", "deepspeed.runtime.fp16.onebit.lamb"):
        kind, message = out[name]
        assert kind == "ImportError" and "\n" not in message
        assert message.startswith("deepspeed.runtime.fp16.onebit (OnebitAdam, ZeroOneAdam, OnebitLamb) is not "
                                  "provided") and "use Adam" in message
    kind, message = out["deepspeed.launcher.multinode_runner"]
    assert kind == "ImportError" and "\n" not in message and "deepspeed --launcher NAME" in message


def test_deprecated_deepscale_config_flag_names_the_config(tmp_path):
    """--deepscale_config (DeepSpeed's deprecated name, which it still reads) gives the config
    as --deepspeed_config does; both at once is one line."""
    import argparse

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import ConfigError

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "steps_per_print": 10 ** 9,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepscale_config", str(path)])
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=torch.nn.Linear(2, 1))
    assert engine.train_batch_size() == 2 and optimizer.param_groups[0]["lr"] == 0.5
    both = argparse.Namespace(deepscale_config=str(path), deepspeed_config=str(path))
    with pytest.raises(ConfigError, match="config: given both as --deepscale_config and --deepspeed_config"):
        deepspeed.initialize(args=both, model=torch.nn.Linear(2, 1))
