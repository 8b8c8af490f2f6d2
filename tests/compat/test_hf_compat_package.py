"""The `deepspeed` compatibility package as transformers and Accelerate see it (installed by
`dslaunch install-deepspeed-compat --target`, then imported in a fresh interpreter):
version and metadata, the module tree they import, and the `deepspeed` command."""
import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent('''
    import importlib.metadata, inspect, json
    import torch
    import deepspeed
    import dslaunch.runtime as rt
    out = {"version": deepspeed.__version__, "metadata": importlib.metadata.version("deepspeed")}

    from transformers.integrations.deepspeed import is_deepspeed_available as hf_has
    from transformers.dependency_versions_check import dep_version_check
    from accelerate.utils import is_deepspeed_available as acc_has, compare_versions
    dep_version_check("deepspeed")  # transformers' own gate (deepspeed>=0.9.3): raises if unmet
    from accelerate.utils.constants import BETA_SP_AVAILABLE_DEEPSPEED_VERSION as sp_min
    out["gates"] = [hf_has(), acc_has(), compare_versions("deepspeed", ">=", "0.16.4"),
                    compare_versions("deepspeed", ">=", sp_min), compare_versions("deepspeed", "<", "0.19.9")]

    # every module the two libraries import resolves to dslaunch's, not to a copy
    import deepspeed.runtime.engine, deepspeed.runtime.lr_schedules, deepspeed.runtime.zero
    import deepspeed.comm, deepspeed.accelerator, deepspeed.checkpoint.utils, deepspeed.launcher.runner
    from deepspeed.utils import logger, set_z3_leaf_modules, is_initialized
    out["same"] = [deepspeed.runtime.engine.DeepSpeedEngine is rt.DeepSpeedEngine,
                   deepspeed.DeepSpeedEngine is rt.DeepSpeedEngine,
                   deepspeed.runtime.zero is rt.zero and deepspeed.zero is rt.zero,
                   deepspeed.comm is rt.comm, deepspeed.initialize is rt.initialize,
                   deepspeed.runtime.engine.__spec__.name == "dslaunch.runtime.train.engine",
                   deepspeed.zero.Init is rt.zero.Init,
                   deepspeed.zero.GatheredParameters is rt.zero.GatheredParameters]
    import deepspeed.sequence.layer
    out["same"].append(deepspeed.sequence.layer.DistributedAttention is rt.sequence.layer.DistributedAttention)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    import dslaunch.runtime.sequence_parallel.ulysses_sp as usp
    out["same"] += [UlyssesSPAttentionHF is usp.UlyssesSPAttentionHF,
                    UlyssesSPDataLoaderAdapter is usp.UlyssesSPDataLoaderAdapter]
    import deepspeed.ops.adam, deepspeed.ops.lion, deepspeed.ops.adagrad, dslaunch.runtime.ops as ops
    out["ops"] = [deepspeed.ops.adam.DeepSpeedCPUAdam is ops.adam.DeepSpeedCPUAdam,
                  deepspeed.ops.adam.FusedAdam is ops.adam.FusedAdam,
                  deepspeed.ops.lion.DeepSpeedCPULion is ops.lion.DeepSpeedCPULion,
                  deepspeed.ops.adagrad.DeepSpeedCPUAdagrad is ops.adagrad.DeepSpeedCPUAdagrad]
    import deepspeed.checkpointing, dslaunch.runtime.activation_checkpointing as ac
    out["ops"].append(deepspeed.checkpointing.checkpoint is ac.checkpointing.checkpoint)
    out["schedules"] = deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    out["env_name"] = deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME
    out["init_distributed"] = sorted(inspect.signature(deepspeed.comm.init_distributed).parameters)
    out["init_kwargs"] = "config_dict_or_path" in inspect.signature(deepspeed.zero.Init).parameters
    out["register_external_parameter"] = callable(deepspeed.zero.register_external_parameter)
    out["initialize"] = sorted(inspect.signature(deepspeed.initialize).parameters)
    t = torch.arange(10.0)
    c = deepspeed.checkpoint.utils.clone_tensors_for_torch_save({"a": [t[2:4]], "b": 3})
    out["clone"] = [c["a"][0].tolist(), c["a"][0].untyped_storage().size() == 8, c["b"]]
    logger.setLevel("WARNING")
    # AutoTP's entry points, where DeepSpeed 0.19 has them: tp_model_init records (shards nothing)
    import deepspeed.runtime.tensor_parallel as ds_tp
    from deepspeed.module_inject import set_autotp_mode
    lin = torch.nn.Linear(2, 2)
    out["tp"] = [deepspeed.tp_model_init(lin, tp_size=2, dtype=torch.float32) is lin,
                 ds_tp.recorded_tp_model_init().tp_size, ds_tp.is_autotp_training_mode(),
                 set_autotp_mode is rt.set_autotp_mode, ds_tp.AUTOTP_MODE.TRAINING.value,
                 ds_tp.merge_tp_model_init_into_config({})["tensor_parallel"]["autotp_size"],
                 callable(deepspeed.checkpointing.model_parallel_cuda_manual_seed),
                 callable(deepspeed.checkpointing.get_cuda_rng_tracker)]
    try:
        deepspeed.tp_model_init(lin, tp_size=4, dtype=torch.float32)
    except deepspeed.DeepSpeedConfigError as exc:
        out["tp"].append(str(exc))
    try:
        import deepspeed.no_such_module
    except ModuleNotFoundError as exc:
        out["missing"] = str(exc)
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def probe(deepspeed_compat):
    res = subprocess.run([sys.executable, "-c", PROBE], env=deepspeed_compat.env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_version_is_honest_and_passes_the_libraries_gates(probe):
    ours = importlib.metadata.version("dslaunch")
    assert probe["version"] == probe["metadata"] == f"0.19.8+dslaunch.{ours}"
    # transformers and Accelerate find it; Accelerate's gates for AutoTP (>= 0.16.4) and for
    # Ulysses sequence parallelism (>= 0.18.2) pass; the API level is the DeepSpeed release
    # the fixtures and benchmarks compare against
    assert probe["gates"] == [True, True, True, True, True]


def test_module_tree_maps_onto_dslaunch_runtime(probe):
    assert all(probe["same"]), probe["same"]
    # deepspeed.ops.{adam,lion,adagrad}: dslaunch.runtime.ops's classes; deepspeed.checkpointing
    assert all(probe["ops"]), probe["ops"]
    assert probe["schedules"] == ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    assert probe["env_name"] == ".deepspeed_env"
    assert {"dist_backend", "auto_mpi_discovery", "timeout"} <= set(probe["init_distributed"])
    assert probe["init_kwargs"] and probe["register_external_parameter"]
    assert {"model", "config_params", "optimizer", "lr_scheduler", "mpu", "model_parameters"} <= set(probe["initialize"])
    assert probe["clone"] == [[2.0, 3.0], True, 3]
    assert probe["tp"][:8] == [True, 2, True, True, "TRAINING", 2, True, True]
    assert "tp_model_init: called again with tp_size=4" in probe["tp"][8]
    assert "deepspeed.no_such_module" in probe["missing"]


@pytest.mark.timeout(120)
def test_deepspeed_command_is_dslaunch(deepspeed_compat, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    from dist_harness import free_port

    port = free_port()  # an explicit port must be free even for a dry run: no fixed one here
    res = subprocess.run(["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--dry_run", "--json",
                          str(script), "--x", "1"], env=deepspeed_compat.env(), capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["world_size"] == 2 and plan["master_port"] == port
    res = subprocess.run(["deepspeed", "--num_gpus", "2", str(script)], env=deepspeed_compat.env(),
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0 and sorted(res.stdout.splitlines()) == ["[rank 0] hi", "[rank 1] hi"]
