"""`deepspeed.runtime.fp16.onebit`: DeepSpeed's 1-bit Adam, 0/1 Adam and 1-bit LAMB, refused.

They compress gradients inside their own error-compensated all-reduce (DeepSpeed's
NCCL/MPI compressed back-ends), which dslaunch does not implement; the config's
"optimizer" types OneBitAdam / ZeroOneAdam / OneBitLamb are refused with the same reason
(runtime/optim.py). Importing this package (or .adam, .zoadam, .lamb under it) says so in
one line instead of a bare ModuleNotFoundError.
"""
from ...train.optim import REFUSED

raise ImportError(f"deepspeed.runtime.fp16.onebit (OnebitAdam, ZeroOneAdam, OnebitLamb) is not provided: "
                  f"{REFUSED['onebitadam']} or Lamb")
