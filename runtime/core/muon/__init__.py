"""DeepSpeed's Muon optimizer (`"optimizer": {"type": "Muon"}`): Newton-Schulz-orthogonalised
momentum for hidden 2-D weights, an auxiliary Adam(W) for the rest.

  newton_schulz.py  the per-matrix maths, batched over same-shaped matrices
  tagging.py        which parameters Muon steps (`use_muon`) and the two halves' param groups
  optimizer.py      MuonWithAuxAdam, the optimizer object (stage 0 computes updates in its step)
  sharded.py        ZeRO stages 1-3: updates from partitioned gradients, momentum partitioned
"""
from .optimizer import MuonWithAuxAdam
from .tagging import tag_parameters

__all__ = ["MuonWithAuxAdam", "tag_parameters"]
