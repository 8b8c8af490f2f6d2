"""`deepspeed.ops.aio`: the async-I/O op's builder, as DeepSpeed exports it from this path.

Scripts (and DeepSpeed's tests) ask `deepspeed.ops.__compatible_ops__[AsyncIOBuilder.NAME]`
before choosing NVMe offload; the builder is op_builder's, which answers False here (NVMe
offload reads and writes through torch's file I/O, with no libaio op), so such code takes its
no-libaio path, as on a DeepSpeed install without libaio.
"""
from .op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
