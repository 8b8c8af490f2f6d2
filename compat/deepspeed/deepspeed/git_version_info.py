"""`deepspeed.git_version_info`: what DeepSpeed records about its build. Here it describes the
compatibility package and the torch it runs on (DeepSpeed's own build writes zeros where it
built no ops, as a pip install without DS_BUILD_OPS does)."""
import torch

from .version import __version__ as version

git_hash = "unknown"
git_branch = "unknown"
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
# dslaunch builds its kernels at first use (dslaunch.kernels), none ahead of time
installed_ops = {"cpu_adam": False, "cpu_adagrad": False, "cpu_lion": False, "fused_adam": False, "async_io": False}
compatible_ops = dict(installed_ops)
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
    "nccl_version": ".".join(str(v) for v in torch.cuda.nccl.version()[:2]) if torch.cuda.is_available() else "0.0",
    "hip_version": "0.0",
}
