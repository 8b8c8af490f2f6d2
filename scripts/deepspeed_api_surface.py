"""Write the table of DeepSpeed's public API as users import it, and what dslaunch's
compatibility package does with each name.

    .venv/bin/python scripts/deepspeed_api_surface.py --ds-python /work/ds-venv/bin/python \\
        --scan transformers=SITE/transformers --scan accelerate=SITE/accelerate \\
        --scan Megatron-DeepSpeed=DIR --scan DeepSpeedExamples=DIR

Two kinds of entry, users' first:
- every `deepspeed.*` name the scanned code imports or reads (`from deepspeed.x import y`,
  `import deepspeed.x`, `deepspeed.x.y` attribute chains), counted per source;
- the public names of the modules users import (MODULES): what DeepSpeed defines there.
Each is looked up under real DeepSpeed (`--ds-python`, a separate environment, as
make_ds_fixtures.py uses) and under ours (this interpreter, compat/deepspeed on the path),
both through scripts/api_probe.py. A name DeepSpeed itself lacks (a version's leftover, a
URL in a docstring) is dropped.

Status of an entry:
  provided   ours resolves it, and its signature accepts DeepSpeed's arguments (`compatible`);
  differs    provided with a documented difference (DIFFERENCES: the reason);
  refused    deliberately absent (REFUSED, by name prefix: the reason);
  missing    none of the above: work to do.
`--restatus` probes only our side again for the recorded entries (a name added here).
Writes tests/data/deepspeed_api.json (tests/compat/test_deepspeed_api.py re-checks every entry
against the package, so the table cannot claim what the package does not do) and
docs/deepspeed-api.md.
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
from typing import Dict, Iterable, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROBE = os.path.join(HERE, "api_probe.py")
JSON_OUT = os.path.join(ROOT, "tests", "data", "deepspeed_api.json")
DOC_OUT = os.path.join(ROOT, "docs", "deepspeed-api.md")
COMPAT = os.path.join(ROOT, "compat", "deepspeed")

# The modules whose whole public API is listed (issue #23 §3), beside the users' names.
MODULES = [
    "deepspeed", "deepspeed.comm", "deepspeed.zero", "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.config", "deepspeed.runtime.fp16.loss_scaler", "deepspeed.utils",
    "deepspeed.utils.groups", "deepspeed.runtime.utils", "deepspeed.checkpoint", "deepspeed.utils.zero_to_fp32",
    "deepspeed.accelerator", "deepspeed.launcher.runner", "deepspeed.runtime.lr_schedules", "deepspeed.pipe",
    "deepspeed.ops.adam", "deepspeed.ops.lion", "deepspeed.ops.adagrad", "deepspeed.checkpointing",
    "deepspeed.monitor.monitor", "deepspeed.module_inject",
]

# Deliberately absent, by name prefix (the longest matching prefix wins): the reason a user reads.
REFUSED: Dict[str, str] = {
    "deepspeed.ops.sparse_attention": "block-sparse attention runs on Triton/CUDA kernels in DeepSpeed; "
                                      "use torch's scaled_dot_product_attention",
    "deepspeed.inference.v2": "DeepSpeed-FastGen (ragged batching) is GPU-only; dslaunch serves with init_inference",
    "deepspeed.inference.RaggedInferenceEngineConfig": "DeepSpeed-FastGen is GPU-only",
    "deepspeed.inference.DeepSpeedTPConfig": "configures DeepSpeed-FastGen (GPU-only); init_inference takes "
                                             "tensor_parallel={\"tp_size\": N}",
    "deepspeed.DeepSpeedTransformerLayer": "DeepSpeed's fused CUDA transformer kernel; not provided",
    "deepspeed.DeepSpeedTransformerConfig": "configures DeepSpeed's fused CUDA transformer kernel; not provided",
    "deepspeed.DeepSpeedHybridEngine": "DeepSpeed-Chat's RLHF hybrid engine; not provided",
    "deepspeed.DualPipeVEngine": "DeepSpeed's DualPipeV schedule; dslaunch's pipeline runs 1F1B",
    "deepspeed.DualPipeVModule": "DeepSpeed's DualPipeV schedule; dslaunch's pipeline runs 1F1B",
    "deepspeed.runtime.data_pipeline": "DeepSpeed's data efficiency library (curriculum, random-LTD); not provided",
    "deepspeed.sequence.fpdt_layer": "FPDT's chunked attention, FFN and loss (sequence parallelism with offload, "
                                     "flash-attn on CUDA) are not provided; Ulysses is (deepspeed.sequence.layer)",
    "deepspeed.ops.op_builder.AsyncIOBuilder": "NVMe offload in dslaunch uses its own aio through torch's file "
                                              "I/O, not DeepSpeed's libaio op",
    "deepspeed.ops.op_builder.GDSBuilder": "GPUDirect Storage is CUDA-only",
    "deepspeed.ops.op_builder.builder.OpBuilder": "dslaunch builds its kernels itself (dslaunch.kernels)",
    "deepspeed.runtime.state_dict_factory": "Megatron-LM's checkpoint-splitting loader for DeepSpeed's "
                                            "old inference engine",
    "deepspeed.env_report": "use `dslaunch check` and `dslaunch --version`",
    "deepspeed.module_inject.replace_transformer_layer": "kernel injection swaps in DeepSpeed's CUDA kernels",
    "deepspeed.replace_transformer_layer": "kernel injection swaps in DeepSpeed's CUDA kernels",
    "deepspeed.module_inject.revert_transformer_layer": "kernel injection swaps in DeepSpeed's CUDA kernels",
    "deepspeed.module_inject.quantize_transformer_layer": "kernel injection swaps in DeepSpeed's CUDA kernels",
    "deepspeed.module_inject.generic_injection": "kernel injection swaps in DeepSpeed's CUDA kernels",
    "deepspeed.module_inject.HFBertLayerPolicy": "a kernel-injection policy",
    "deepspeed.module_inject.DSPolicy": "a kernel-injection policy",
    "deepspeed.module_inject.GroupQuantizer": "kernel injection's int8 weight quantizer (CUDA)",
    "deepspeed.comm.CCLBackend": "Intel oneCCL backend; dslaunch speaks gloo and NCCL through torch",
    "deepspeed.comm.in_aml": "Azure ML environment sniffing; dslaunch's launcher sets the contract variables",
    "deepspeed.comm.in_aws_sm": "SageMaker environment sniffing; dslaunch's launcher sets the contract variables",
    "deepspeed.comm.in_dlts": "DLTS environment sniffing; dslaunch's launcher sets the contract variables",
    "deepspeed.comm.patch_aml_env_for_torch_nccl_backend": "Azure ML environment patching; not needed",
    "deepspeed.comm.patch_aws_sm_env_for_torch_nccl_backend": "SageMaker environment patching; not needed",
    "deepspeed.comm.mpi_discovery": "dslaunch's cluster shim maps MPI's variables (launcher/cluster_env.py)",
    "deepspeed.comm.enable_symm_mem_for_group": "CUDA symmetric memory; not provided",
    "deepspeed.comm.initialize_mesh_device": "DeepSpeed's DeviceMesh helper; dslaunch's mesh is runtime.parallel",
    "deepspeed.launcher.runner.IMPIRunner": "Intel MPI is not a dslaunch launcher (ssh, pdsh, openmpi, slurm)",
    "deepspeed.launcher.runner.MPICHRunner": "MPICH is not a dslaunch launcher (ssh, pdsh, openmpi, slurm)",
    "deepspeed.launcher.runner.MVAPICHRunner": "MVAPICH is not a dslaunch launcher (ssh, pdsh, openmpi, slurm)",
}

REFUSED.update({
    "deepspeed.compile": "DeepCompile's graph passes; dslaunch compiles with torch.compile (the `compile` config "
                         "section)",
    "deepspeed.io": "DeepSpeed's fast checkpoint writers; dslaunch writes checkpoints with torch.save",
    "deepspeed.runtime.domino": "Domino (overlapped TP communication) is not provided",
    "deepspeed.utils.timer": "the engine's timers report under dslaunch's names (wall_clock_breakdown)",
    "deepspeed.runtime.fp16.fused_optimizer": "the FP16 optimizer wrapper is inside the engine; set fp16 in the config",
    "deepspeed.runtime.fp16.unfused_optimizer": "the FP16 optimizer wrapper is inside the engine; set fp16 in the "
                                                "config",
    "deepspeed.comm.TorchBackend": "deepspeed.comm's backend object; dslaunch's comm calls torch.distributed directly",
    "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum": "engine.offload_states() is not provided",
})

def _internal(module: str, names: str, reason: str) -> None:
    for name in names.split():
        REFUSED[f"{module}.{name}"] = reason


ZERO3 = "an internal of DeepSpeed's ZeRO-3 partitioner (dslaunch's is runtime/zero)"
_internal("deepspeed.runtime.zero.partition_parameters",
          "AllGatherCoalescedHandle AllGatherHandle AllReduceCoalescedHandle AsyncPartitionedParameterSwapper "
          "CUDAQuantizer InsertPostInitMethodToModuleSubClasses NoGatherCoalescedHandle "
          "NoGatherHandle QuantizationInfo assert_ints_same_as_other_ranks debug_module2name debug_param2name_id "
          "debug_param2name_id_shape debug_param2name_id_shape_device debug_param2name_id_shape_status debug_rank0 "
          "free_param get_all_subclasses get_comm_dtype get_config_default "
          "get_new_tensor_fn_for_dtype get_only_unique_item has_comm_dtype instrument_w_nvtx keep_buffers_in_fp32 "
          "keep_in_fp32_pattern print_rank_0 restore_init_context shutdown_init_context sort_dtypes "
          "wrap_load_from_state_dict wrap_quantized_functional "
          "zero_wrapper_for_fp_tensor_constructor get_accelerator init_distributed see_memory_usage "
          "DeepSpeedZeroConfig OffloadDeviceEnum", ZERO3)
_internal("deepspeed.runtime.utils",
          "DummyOptim OutputBackwardHookManager TLinear align_dense_tensors all_gather_dp_groups "
          "all_gather_into_tensor_dp_groups bwc_pipeline_parallel_group bwc_pipeline_parallel_world_size "
          "bwc_tensor_model_parallel_rank check_internal_apis_for_count_used_parameters "
          "clip_tensors_by_global_norm combine_grad_norm_groups compare_tensors_in_structures copy_to_device "
          "empty_cache ensure_directory_exists filter_empty_parameters "
          "get_accelerator get_checkpoint_folder_size get_flattened_grad_norm get_global_norm "
          "get_global_norm_of_tensors get_grad_zeros get_inactive_params get_ma_status get_norm_with_moe_layers "
          "get_norm_with_moe_layers_fast get_only_unique_item get_tensor_bytes has_inf_or_nan "
          "is_invalid_grad_norm is_moe_param is_optimized_parameter is_transformers_cache "
          "mask_nan_or_inf_with_val_inplace maybe_loss_for_backward memory_status noop_context noop_decorator "
          "offload_adam_states partition_uniform prefix_sum_inc register_output_backward_hooks "
          "reload_adam_states transpose",
          "an internal of DeepSpeed's engine and optimizers")
_internal("deepspeed.comm",
          "get_caller_func get_debug_log_name get_default_args get_msg_size_from_args get_tensor_kwarg "
          "get_tensor_position timed_op init_deepspeed_backend set_backend has_coalescing_manager ProcessGroup "
          "get_local_rank_from_launcher get_world_rank_from_launcher get_world_size_from_launcher get_accelerator "
          "CommsLogger",
          "deepspeed.comm's own logging and back-end plumbing; dslaunch's comm logs through the comms_logger "
          "config and reads ranks from the launcher's contract variables")
_internal("deepspeed.utils.zero_to_fp32",
          "GatheredTensor atoi natural_keys get_model_state_file parse_model_states parse_optim_states to_torch_tensor "
          "zero3_partitioned_param_info zero_model_state",
          "an internal of DeepSpeed's recovery script; its entry points (get_fp32_state_dict_from_zero_checkpoint, "
          "convert_zero_checkpoint_to_*state_dict, load_state_dict_from_zero_checkpoint) are provided")
_internal("deepspeed.launcher.runner",
          "Autotuner OpenMPIRunner PDSHRunner SlurmRunner apply_num_nodes_and_gpus encode_world_info "
          "fetch_hostfile get_accelerator parse_args parse_inclusion_exclusion parse_node_config "
          "parse_node_config_list run_autotuning set_log_level_from_string",
          "an internal of DeepSpeed's launcher; dslaunch's launcher is the `dslaunch` command (and `deepspeed` "
          "through the compatibility package)")
_internal("deepspeed.runtime.lr_schedules",
          "add_tuning_arguments get_config_from_args get_lr_from_config get_torch_optimizer override_1cycle_params "
          "override_lr_range_test_params override_params override_warmupCosineLR_params override_warmupLR_params "
          "parse_arguments update_lr",
          "command-line plumbing of DeepSpeed's LR-schedule tuning; schedules come from the config's scheduler "
          "section")
_internal("deepspeed.runtime.zero.config",
          "DeepSpeedConfigModel get_scalar_param pp_int read_zero_config_deprecated",
          "DeepSpeed's pydantic plumbing; the schema is a dataclass here")
_internal("deepspeed.runtime.fp16.loss_scaler",
          "DeepSpeedConfigObject LossScaleConfig LossScaleProfile LossScaleProfileDefaults log_dist",
          "an internal of DeepSpeed's fp16 optimizer wrapper")
_internal("deepspeed", "merge_tp_model_init_into_config record_tp_model_init_args",
          "internals behind tp_model_init (provided)")
_internal("deepspeed", "resolve_per_head_muon_after_sharding set_optimizer_flags DeepSpeedOptimizer",
          "an internal of DeepSpeed's optimizer setup")
for _name in ("deepspeed.runtime.zero.config.ZenFlowConfig", "deepspeed.ops.adam.ZenFlowCPUAdam",
              "deepspeed.ops.adam.ZenFlowSelectiveAdamW", "deepspeed.ops.adam.ZenFlowSelectiveAdamW_stage3"):
    REFUSED[_name] = "ZenFlow (stall-free offload) is not provided"
_internal("deepspeed.utils", "bwc_pipeline_parallel_world_size bwc_tensor_model_parallel_world_size get_caller_func "
          "get_numactl_cmd get_accelerator lazy_init_hp_params_optimizer_state link_hp_params map_to_flat_opt_states "
          "get_hp_fragment_mapping fragment_address tensor_fragment",
          "an internal of DeepSpeed's engine, launcher or optimizer-fragment bookkeeping")
REFUSED["deepspeed.pipe.DualPipeVModule"] = "DeepSpeed's DualPipeV schedule; dslaunch's pipeline runs 1F1B"
REFUSED["deepspeed.DeepSpeedDataLoader"] = "the engine builds its loader from training_data (engine.training_dataloader)"


# Provided with a difference the user should know.
DIFFERENCES: Dict[str, str] = {
    "deepspeed.sequence.fpdt_layer.FPDT_Attention": "named so Megatron-DeepSpeed's imports resolve; constructing it "
                                                    "raises with the reason (FPDT's chunked attention kernels need "
                                                    "flash-attn on CUDA); its input layout, FPDT_InputConstruct, "
                                                    "is provided",
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer": "named for isinstance checks (nothing is one: the "
                                                             "engine keeps fp16 in its strategy); constructing it "
                                                             "raises with the reason",
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer": "named for isinstance checks (nothing is one: "
                                                                      "the engine keeps fp16 in its strategy); "
                                                                      "constructing it raises with the reason",
    "deepspeed.initialize": "mesh_param=(data, sequence) builds the mesh sequence_parallel_size builds, with "
                            "gradients averaged over data x sequence; DeepSpeed 0.19.8 reduces them over the data "
                            "group alone, so its sequence ranks drift apart",
    "deepspeed.DeepSpeedConfig": "a typed dataclass of the JSON (unknown keys are errors); the three batch-size "
                                 "keys come out resolved, as in DeepSpeed",
    "deepspeed.zero.Init": "mem_efficient_linear has nothing to switch (F.linear keeps only its input); "
                           "remote_device on a CUDA machine and zero_param_parallel_group (hpZ's group comes from the "
                           "config and the hosts) are refused in one line",
    "deepspeed.DeepSpeedEngine": "mesh_device is refused; the engine builds its mesh from the config and mpu",
}


# ---------------------------------------------------------------------------------- scanning

def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def public_prefix(name: str) -> Optional[str]:
    """`name` cut before its first private part (`_INSTRUCTION_MAP.update`), dunders kept."""
    out = []
    for part in name.split("."):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            break
        out.append(part)
    return ".".join(out) if len(out) > 1 else None


def scan(root: str) -> collections.Counter:
    """deepspeed.* names the Python files under root import or read."""
    seen: collections.Counter = collections.Counter()
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            try:
                with open(os.path.join(folder, f), encoding="utf-8", errors="replace") as fh:
                    tree = ast.parse(fh.read())
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                names: Iterable[str] = ()
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "deepspeed":
                    names = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names if a.name.startswith("deepspeed.")]
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    d = _dotted(node)
                    names = [d] if d and d.startswith("deepspeed.") else []
                for n in names:
                    n = public_prefix(n)
                    if n:
                        seen[n] += 1
    return seen


def _drop_prefixes(names: Iterable[str]) -> List[str]:
    """Keep `a.b.c` and drop `a.b` when both appear as users' names only by attribute chains
    would double count; modules stay (they are imported on their own)."""
    return sorted(set(names))


# ----------------------------------------------------------------------------- comparison

def compatible(ds_params, our_params) -> Optional[str]:
    """None if a call written for DeepSpeed's signature binds to ours, else why not."""
    if ds_params is None or our_params is None:
        return None  # nothing to compare (builtins, classes without an __init__ of their own)
    if all(p[1] in ("VAR_POSITIONAL", "VAR_KEYWORD") for p in ds_params):
        return None  # DeepSpeed's decorator (comm's timed_op) hides the real parameters
    ours = {p[0]: p for p in our_params}
    var_kw = any(p[1] == "VAR_KEYWORD" for p in our_params)
    var_pos = any(p[1] == "VAR_POSITIONAL" for p in our_params)
    for name, kind, _ in ds_params:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if kind == "VAR_POSITIONAL" and not var_pos:
                return f"DeepSpeed takes *{name}; ours does not"
            continue
        if name not in ours and not (var_kw or (kind == "POSITIONAL_ONLY" and var_pos)):
            return f"no parameter {name!r}"
    ds_names = {p[0] for p in ds_params}
    for name, kind, has_default in our_params:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD") or has_default:
            continue
        if name not in ds_names:
            return f"ours requires {name!r}, which DeepSpeed's callers do not pass"
    # positional order: DeepSpeed's positional parameters must line up with ours
    ds_pos = [p[0] for p in ds_params if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    our_pos = [p[0] for p in our_params if p[1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    for i, name in enumerate(ds_pos):
        if i < len(our_pos) and our_pos[i] != name and not var_pos:
            return f"positional parameter {i} is {name!r} in DeepSpeed, {our_pos[i]!r} here"
        if i >= len(our_pos) and not var_pos:
            return f"DeepSpeed takes {name!r} positionally; ours does not"
    return None


def reason_refused(name: str) -> Optional[str]:
    best = None
    for prefix in REFUSED:
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return REFUSED[best] if best else None


def status_of(name: str, ds: dict, ours: dict) -> "tuple[str, str]":
    """(status, note) of one entry; see the module docstring."""
    if name in DIFFERENCES:
        return "differs", DIFFERENCES[name]
    refused = reason_refused(name)
    if ours.get("found"):
        why = compatible(ds.get("params"), ours.get("params")) if ds.get("kind") == ours.get("kind") or \
            {ds.get("kind"), ours.get("kind")} <= {"class", "function"} else f"a {ours.get('kind')} here, a {ds.get('kind')} in DeepSpeed"
        if why is None:
            return "provided", ""
        return ("refused", refused) if refused else ("missing", f"signature: {why}")
    if refused:
        return "refused", refused
    return "missing", ours.get("error") or "not found"


# ----------------------------------------------------------------------------------- probing

def probe(python: str, modules: List[str], names: List[str], pythonpath: Optional[str] = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    res = subprocess.run([python, PROBE], input=json.dumps({"modules": modules, "names": names}), env=env,
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"{python} {PROBE} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def build(ds_python: str, scans: Dict[str, str]) -> dict:
    users: Dict[str, Dict[str, int]] = collections.defaultdict(dict)
    for source, root in scans.items():
        for name, count in scan(root).items():
            users[name][source] = count
    ds_modules = probe(ds_python, MODULES, [])["modules"]
    listed = {f"{m}.{n}" if m != "deepspeed" else f"deepspeed.{n}": m
              for m, names in ds_modules.items() if isinstance(names, list) for n in names}
    every = sorted(set(users) | set(listed))
    ds = probe(ds_python, [], every)["names"]
    every = [n for n in every if ds[n]["found"]]
    ours = probe(sys.executable, [], every, pythonpath=COMPAT)["names"]
    entries = []
    for name in every:
        status, note = status_of(name, ds[name], ours[name])
        entries.append({"name": name, "users": users.get(name, {}), "module": listed.get(name),
                        "kind": ds[name]["kind"], "params": ds[name]["params"], "status": status, "note": note})
    entries.sort(key=lambda e: (-sum(e["users"].values()), e["name"]))
    version = subprocess.run([ds_python, "-c", "import importlib.metadata as m; print(m.version('deepspeed'))"],
                             capture_output=True, text=True).stdout.strip()
    return {"deepspeed_version": version, "sources": sorted(scans), "modules": MODULES, "entries": entries}


# ----------------------------------------------------------------------------------- writing

def counts(entries: List[dict]) -> Dict[str, int]:
    c = collections.Counter(e["status"] for e in entries)
    return {k: c.get(k, 0) for k in ("provided", "differs", "refused", "missing")}


def render(table: dict) -> str:
    entries = table["entries"]
    used = [e for e in entries if e["users"]]
    lines = [
        "# DeepSpeed's API in the compatibility package",
        "",
        f"Every `deepspeed.*` name that {', '.join(table['sources'])} import, and the public API of the modules "
        f"users import, looked up in DeepSpeed {table['deepspeed_version']} and in dslaunch's `deepspeed` "
        "compatibility package. Written by `scripts/deepspeed_api_surface.py`; `tests/compat/test_deepspeed_api.py` "
        "checks every row against the package.",
        "",
        "- **provided**: importable, and its signature accepts DeepSpeed's arguments;",
        "- **differs**: provided, with the difference noted;",
        "- **refused**: deliberately absent, with the reason;",
        "- **missing**: not there yet.",
        "",
        "| | provided | differs | refused | missing | total |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in (("names users import", used), ("all entries", entries)):
        c = counts(rows)
        lines.append(f"| {label} | {c['provided']} | {c['differs']} | {c['refused']} | {c['missing']} | {len(rows)} |")
    lines += ["", "## Names users import", "", "| name | used by | status | note |", "|---|---|---|---|"]
    for e in used:
        by = ", ".join(f"{s} ({n})" for s, n in sorted(e["users"].items()))
        lines.append(f"| `{e['name']}` | {by} | {e['status']} | {_cell(e['note'])} |")
    by_module: Dict[str, List[dict]] = collections.defaultdict(list)
    for e in entries:
        if e["module"]:
            by_module[e["module"]].append(e)
    lines += ["", "## Public API by module", ""]
    for module in table["modules"]:
        rows = sorted(by_module.get(module, []), key=lambda e: e["name"])
        if not rows:
            continue
        c = counts(rows)
        lines += [f"### `{module}`", "",
                  f"{c['provided']} provided, {c['differs']} differ, {c['refused']} refused, {c['missing']} missing "
                  f"of {len(rows)}.", "", "| name | status | note |", "|---|---|---|"]
        for e in rows:
            lines.append(f"| `{e['name'][len(module) + 1:] if module != 'deepspeed' else e['name'][10:]}` | "
                         f"{e['status']} | {_cell(e['note'])} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def restatus(table: dict) -> dict:
    """The table with every entry's status probed again under our package, DeepSpeed's side
    (its names, signatures and the users' counts) kept as recorded: what changes when a name
    is added here, without DeepSpeed or the scanned trees at hand."""
    ours = probe(sys.executable, [], [e["name"] for e in table["entries"]], pythonpath=COMPAT)["names"]
    for e in table["entries"]:
        e["status"], e["note"] = status_of(e["name"], {"kind": e["kind"], "params": e["params"]}, ours[e["name"]])
    return table


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ds-python", help="the interpreter of an environment with real DeepSpeed")
    ap.add_argument("--scan", action="append", default=[], metavar="NAME=DIR",
                    help="a source tree whose deepspeed imports count as users' names")
    ap.add_argument("--restatus", action="store_true",
                    help="only probe our package again for the recorded entries (no DeepSpeed, no scans)")
    args = ap.parse_args(argv)
    if args.restatus:
        with open(JSON_OUT) as fh:
            table = restatus(json.load(fh))
        _write(table)
        return
    if not args.ds_python:
        ap.error("--ds-python is required (unless --restatus)")
    scans = {}
    for item in args.scan:
        name, sep, path = item.partition("=")
        if not sep or not os.path.isdir(path):
            ap.error(f"--scan {item!r}: expected NAME=DIR with an existing DIR")
        scans[name] = path
    _write(build(args.ds_python, scans))


def _write(table: dict) -> None:
    with open(JSON_OUT, "w") as fh:
        json.dump(table, fh, indent=1, sort_keys=True)
        fh.write("\n")
    with open(DOC_OUT, "w") as fh:
        fh.write(render(table))
    used = [e for e in table["entries"] if e["users"]]
    print(f"users' names: {counts(used)} of {len(used)}; all: {counts(table['entries'])} of {len(table['entries'])}")


if __name__ == "__main__":
    main()
