"""The cases scripts/make_ds_offload_states_fixtures.py asks DeepSpeed 0.19.8 and
tests/runtime/zero/test_offload_states_vs_deepspeed.py replays with dslaunch."""

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

# which states engine.offload_states moves, by (stage, offload_optimizer, include)
INCLUDE_CASES = {f"s{stage}-{'host' if host else 'dev'}-{name}": (stage, host, include)
                 for stage in (1, 2, 3) for host in (False, True)
                 for name, include in (("all", None), *((k, [k]) for k in KINDS),
                                       ("lp+optim", ["lp_params", "optim_states"]))}

# zero.Init's one-rank-group check: (dp_world_size, an explicit group given, env)
PG_CASES = {"launcher-8": (1, False, {"WORLD_SIZE": "8"}), "launcher-2": (1, False, {"WORLD_SIZE": "2"}),
            "single": (1, False, {"WORLD_SIZE": "1"}), "no-env": (1, False, {}),
            "sharded": (8, False, {"WORLD_SIZE": "8"}), "explicit": (1, True, {"WORLD_SIZE": "8"}),
            "empty": (1, False, {"WORLD_SIZE": ""}), "garbage": (1, False, {"WORLD_SIZE": "eight"}),
            "zero": (1, False, {"WORLD_SIZE": "0"})}

# CUDAQuantizer.quantize's block count for a tensor of n elements (groups=None)
QUANTIZER_NUMELS = (8, 64, 4096, 8000, 8008, 16000, 24000, 65536, 1 << 20)


class RecordingQuantizerOp:
    """Stands in for CUDAQuantizer's compiled op on both sides: records the block count, bits
    and input dtype each quantize call gets (DeepSpeed's CUDA op cannot be built on a CPU)."""

    Symmetric = 0

    def __init__(self):
        self.calls = []

    def quantize(self, param, groups, bits, kind):
        import torch

        self.calls.append({"groups": groups, "bits": bits, "dtype": str(param.dtype)})
        return param.to(torch.int8), torch.ones(groups)

    def dequantize(self, q, scale, groups, bits, kind):
        import torch

        return q.to(torch.half)
