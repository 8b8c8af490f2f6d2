"""`deepspeed.runtime.comm.coalesced_collectives`: DeepSpeed's module path for its coalesced
reduce-scatter (coalesced.py's reduce_scatter_coalesced) and ZeRO++'s quantized all-to-all
gradient reduction, which needs DeepSpeed's quantizer op: dslaunch has none (its
QuantizerBuilder answers False, as DeepSpeed's CPU build does), so it refuses in one line."""
from .coalesced import reduce_scatter_coalesced


def all_to_all_quant_reduce(tensors, groups, *args, **kwargs):
    raise RuntimeError("all_to_all_quant_reduce (ZeRO++ quantized gradients) needs DeepSpeed's quantizer op, "
                       "which dslaunch does not provide (QuantizerBuilder is not compatible here)")


__all__ = ["reduce_scatter_coalesced", "all_to_all_quant_reduce"]
