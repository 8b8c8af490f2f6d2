"""deepspeed.utils.tensor_fragment: where DeepSpeed defines the safe_* accessors; here
they are dslaunch.runtime.zero.fragments' (scripts import them from either place)."""
from dslaunch.runtime.zero.fragments import *  # noqa: F401,F403
from dslaunch.runtime.zero.fragments import __all__  # noqa: F401
