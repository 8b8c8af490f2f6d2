"""`deepspeed.runtime.zero.tiling`: TiledLinear, a linear layer cut into tiles.

A `TiledLinear(in_features, out_features, in_splits=i, out_splits=o)` holds o x i small
linears (`linears[out_id][in_id]`, each of `linear_cls`), tile (r, c) mapping input columns
in_parts[c]:in_parts[c+1] to output rows out_parts[r]:out_parts[r+1]. Its forward cuts the
input's last dimension at in_parts, sums each output row's tiles and joins the rows: the
same function as one nn.Linear with the tiles put together. Under ZeRO-3 each tile is its own
module, so only the tile running is gathered: one huge linear never needs to be whole at once.
Only the last input tile of each row has a bias, so the bias is added once.

The cuts are DeepSpeed's (its partition_uniform): as even as possible, the larger parts first.
"""
from __future__ import annotations

from typing import List

import torch

from .params import GatheredParameters


def uniform_bounds(num_items: int, num_parts: int) -> List[int]:
    """num_parts + 1 boundaries cutting num_items as evenly as possible, the first
    num_items % num_parts parts one larger (parts of 0 and 1 when items are fewer than parts)."""
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def split_tensor_along_last_dim(tensor: torch.Tensor, partitions, contiguous_split_chunks: bool = False):
    """`tensor` cut along its last dimension into pieces of the sizes in `partitions` (views;
    contiguous copies when asked)."""
    pieces = torch.split(tensor, list(partitions), dim=tensor.dim() - 1)
    return tuple(p.contiguous() for p in pieces) if contiguous_split_chunks else pieces


class TiledLinear(torch.nn.Module):
    """nn.Linear(in_features, out_features, bias) computed as in_splits x out_splits tiles.

    input_is_already_split: forward takes a sequence of in_splits inputs (already cut at
    in_parts) instead of one tensor. combine_out_splits False: forward returns the list of
    out_splits row outputs instead of their concatenation. linear_cls and **kwargs build each
    tile; init_linear (an nn.Linear of the full shape) gives the tiles its values.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False, combine_out_splits: bool = True,
                 linear_cls=torch.nn.Linear, init_linear=None, **kwargs):
        super().__init__()
        # DeepSpeed raises RuntimeError here, and callers catch that type
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits {in_splits} must be in [1, in_features={in_features}]")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits {out_splits} must be in [1, out_features={out_features}]")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = uniform_bounds(in_features, in_splits)
        self.out_parts = uniform_bounds(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for r in range(out_splits):
            rows = self.out_parts[r + 1] - self.out_parts[r]
            self.linears.append(torch.nn.ModuleList(
                linear_cls(self.in_parts[c + 1] - self.in_parts[c], rows, bias=bias and c == in_splits - 1, **kwargs)
                for c in range(in_splits)))
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(inputs)} input pieces for in_splits {self.in_splits}")
        else:
            bounds = uniform_bounds(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [b - a for a, b in zip(bounds, bounds[1:])])
        outputs = []
        for r in range(self.out_splits):
            acc = None
            for c in range(self.in_splits):
                acc = self._reduce_local_output(in_id=c, out_id=r, current_out=acc,
                                                new_out=self.linears[r][c](inputs[c]))
            outputs.append(acc)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        """The input cut along its last dimension into `split_sizes` (subclasses with other
        input types override it)."""
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        """Row out_id's running sum with tile (out_id, in_id)'s output added (the first tile's
        output copied, so that the sum never writes into a tile's own result)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        """The row outputs joined along the last dimension."""
        if len(outputs) != self.out_splits:
            raise ValueError(f"TiledLinear: {len(outputs)} row outputs for out_splits {self.out_splits}")
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other) -> None:
        """Give every tile its block of `other`'s weight (and bias), an nn.Linear of the full
        shape. Under ZeRO-3 each tile is gathered for the copy and rank 0's values are kept
        (GatheredParameters with modifier_rank 0): a collective, as in DeepSpeed."""
        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"TiledLinear.copy_params_from: expected a weight of shape "
                             f"({self.out_features}, {self.in_features}), got "
                             f"{None if weight is None else tuple(weight.shape)}")
        other_bias = getattr(other, "bias", None)
        if self.use_bias and (other_bias is None or tuple(other_bias.shape) != (self.out_features,)):
            raise ValueError(f"TiledLinear.copy_params_from: expected a bias of shape ({self.out_features},)")
        if not self.use_bias and other_bias is not None:
            raise ValueError("TiledLinear.copy_params_from: this layer has no bias but the source has one")
        for r in range(self.out_splits):
            r0, r1 = self.out_parts[r], self.out_parts[r + 1]
            for c in range(self.in_splits):
                tile = self.linears[r][c]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, self.in_parts[c]:self.in_parts[c + 1]])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other_bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """TiledLinear over tiles that return (output, bias) (Megatron-LM's linears, which leave
    adding the bias to the caller): the outputs are summed, the biases passed through, and the
    forward returns (output, bias), bias None when no tile gave one."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        if not (isinstance(new_out, tuple) and len(new_out) == 2 and new_out[0] is not None):
            raise ValueError("TiledLinearReturnBias: each tile must return (output, bias)")
        old_out, old_bias = current_out if current_out is not None else (None, None)
        out, bias = new_out
        summed = super()._reduce_local_output(in_id, out_id, old_out, out)
        return summed, (bias if bias is not None else old_bias)

    def _combine_output_splits(self, outputs):
        joined = super()._combine_output_splits([o for o, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return joined, (torch.cat(biases, dim=-1) if biases else None)


__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim"]
