"""Which attention heads each rank of a sequence group attends over (pure arithmetic).

After the first all-to-all a rank holds the whole sequence for a subset of heads. The
subset follows the key/value heads, so that under grouped-query attention a query head
lands on the rank that holds its key/value head (query head j uses key/value head
j // (query heads / key/value heads)):

    head_splits(4, 2)            -> [2, 2]
    head_splits(5, 2)            -> [3, 2]      uneven: the first ranks take one more
    head_splits(8, 2, kv_heads=2) -> [4, 4]     GQA: 4 query heads per key/value head
    head_splits(6, 4, kv_heads=3)  -> SequenceParallelError (3 key/value heads for 4 ranks)

Fewer key/value heads than ranks would leave a rank with nothing to attend over (or ask
for replicated key/value heads, which this does not do): one line names the counts.
"""
from __future__ import annotations

from typing import List, Optional


class SequenceParallelError(ValueError):
    """A layout sequence parallelism cannot split (one line, naming the values)."""


def head_splits(heads: int, sp: int, kv_heads: Optional[int] = None) -> List[int]:
    """Heads per sequence rank, in rank order, for a tensor with `heads` heads of a model
    with `kv_heads` key/value heads (None: `heads` itself, as for keys and values)."""
    heads, sp = int(heads), int(sp)
    kv = heads if kv_heads is None else int(kv_heads)
    if sp < 1:
        raise SequenceParallelError(f"sequence parallel size {sp} must be at least 1")
    if kv < 1 or heads % kv:
        raise SequenceParallelError(f"{heads} heads are not a whole multiple of {kv} key/value heads")
    if kv < sp:
        raise SequenceParallelError(f"{kv} key/value heads cannot be split over sequence parallel size {sp}: "
                                    f"every rank needs at least one; use sp <= {kv}")
    per_kv = heads // kv
    base, extra = divmod(kv, sp)
    return [(base + (1 if r < extra else 0)) * per_kv for r in range(sp)]


def local_length(total: int, sp: int, what: str = "sequence length") -> int:
    """The slice of a sequence of `total` tokens each of `sp` ranks holds; it must split evenly."""
    if total % sp:
        raise SequenceParallelError(f"{what} {total} does not split evenly over sequence parallel size {sp}; "
                                    f"pad it to a multiple of {sp}")
    return total // sp
