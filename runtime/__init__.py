"""dslaunch.runtime: the DeepSpeed-compatible training engine (`import dslaunch.runtime as deepspeed`)."""
