"""The real-world configs of tests/data/configs and how the Hugging Face Trainer fills in
their "auto" values (transformers' HfTrainerDeepSpeedConfig rules, for a model of hidden
size 32, micro batch 2, accumulation 2, 2 ranks, lr 5e-5, max_grad_norm 1.0)."""
import copy
import json
import pathlib

DATA = pathlib.Path(__file__).resolve().parent / "data" / "configs"
HIDDEN, MICRO, GAS, WORLD, LR = 32, 2, 2, 2, 5e-5

TRAINER = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
    "train_batch_size": MICRO * GAS * WORLD, "gradient_clipping": 1.0,
    "optimizer.params.lr": LR, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": LR, "scheduler.params.warmup_num_steps": 0,
    "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
    "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
}
# The precision the Trainer was run with (--fp16 / --bf16 / neither), per file.
PRECISION = {"hf_zero2_auto.json": {"fp16.enabled": True},
             "hf_tests_ds_config_zero2.json": {"fp16.enabled": False, "bf16.enabled": True},
             "hf_zero3_auto.json": {"fp16.enabled": False}}


def fill_auto(raw: dict, values: dict, prefix: str = "") -> dict:
    out = copy.deepcopy(raw)
    for key, value in raw.items():
        path = prefix + key
        if value == "auto":
            out[key] = values[path]
        elif isinstance(value, dict):
            out[key] = fill_auto(value, values, path + ".")
    return out


def published():
    return {p.name: json.loads(p.read_text()) for p in sorted((DATA / "published").glob("*.json"))}


def filled():
    return {p.name: json.loads(p.read_text()) for p in sorted((DATA / "filled").glob("*.json"))}


def runnable():
    """name -> the config as the engine gets it (filled where the Trainer fills it)."""
    out = published()
    out.update(filled())
    return out
