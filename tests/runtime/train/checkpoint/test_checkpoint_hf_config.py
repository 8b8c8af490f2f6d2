"""The HF Trainer's checkpoint setting reaches dslaunch: TrainingArguments(save_on_each_node=True)
writes checkpoint.use_node_local_storage into the DeepSpeed config (transformers'
HfTrainerDeepSpeedConfig), and dslaunch's config takes it (its effect, each node writing and
reading its own files, is tested in test_checkpoint_ranks.py)."""
import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent('''
    import json, tempfile
    from transformers import TrainingArguments
    from dslaunch.runtime.config import DeepSpeedConfig
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    out = {}
    for each_node in (True, False):
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), deepspeed=cfg, save_on_each_node=each_node,
                                 report_to=[], use_cpu=True)
        ds = args.hf_deepspeed_config.config
        out[str(each_node)] = [ds.get("checkpoint"), DeepSpeedConfig.from_dict(ds).checkpoint.use_node_local_storage]
    print(json.dumps(out))
''')


def test_save_on_each_node_becomes_node_local_storage(deepspeed_compat):
    res = subprocess.run([sys.executable, "-c", PROBE], env=deepspeed_compat.env(), capture_output=True, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["True"] == [{"use_node_local_storage": True}, True]
    assert out["False"][1] is False
