"""Make tests/data/ds_autotp_replace.json with real DeepSpeed (0.19.8, CPU): what
`deepspeed.module_inject.auto_tp.AutoTP` does to a small decoder under a partition_config, for
every rank of a 2- and a 3-rank group: which class each module becomes, each parameter's local
values, the head counts and widths it divides, the sliced embedding's universal-checkpoint
metadata; and the ALiBi tensors of `auto_tp_model_utils.build_bloom_alibi_tensor` (one
process, no group: every head).

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_autotp_replace_fixtures.py

One process, no process group: deepspeed.comm's get_rank / get_world_size answer a stand-in
group (scripts/autotp_replace_cases.py), so each rank's layers are built in turn (AutoTP
communicates nothing while it cuts). tests/runtime/tensor_parallel/test_autotp_replace_ds.py
replays our side.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autotp_replace_cases import PARTITION_CONFIG, Decoder, FakeGroup, fake_comm, record  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_autotp_replace.json")


def plain(value):
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k not in ("affine_map", "affine_map_info")}
    if isinstance(value, (list, tuple, torch.Size)):
        return [plain(v) for v in value]
    return value


def main() -> int:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.module_inject.auto_tp import AutoTP, AutoTPConfig
    from deepspeed.module_inject.auto_tp_model_utils import build_bloom_alibi_tensor

    dist.get_rank, dist.get_world_size = fake_comm(dist, dist.get_rank, dist.get_world_size)
    walks = []
    for tp in (2, 3):
        ranks = []
        for rank in range(tp):
            model = Decoder()
            autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None,
                            linear_layer_setting=None, orig_layer_impl=None,
                            partition_config=AutoTPConfig.from_dict(PARTITION_CONFIG), model_config=model.config)
            autotp.set_tensor_parallel_config(tp, FakeGroup(tp, rank))
            # update_linear_policies() is not called: DeepSpeed's imports transformers, and with a
            # partition_config the layer specs route every module without the policies
            autotp._replace_module(model)
            rec = record(model)
            rec["embed_tokens"]["uc_meta"] = plain(getattr(model.embed_tokens.weight, DS_AUTOTP_UC_META))
            ranks.append(rec)
        walks.append({"tp": tp, "ranks": ranks})

    alibi = []
    for heads, mask in ((8, [[1, 1, 1, 1]]), (6, [[0, 1, 1, 1], [1, 1, 1, 0]]), (5, [[1, 1, 1]])):
        out = build_bloom_alibi_tensor(torch.tensor(mask), heads, torch.float32)
        alibi.append({"heads": heads, "mask": mask, "shape": list(out.shape), "values": out.reshape(-1).tolist()})

    with open(OUT, "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "partition_config": PARTITION_CONFIG, "walks": walks,
                   "alibi": alibi}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(walks)} walks, {len(alibi)} alibi tensors to {os.path.normpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
