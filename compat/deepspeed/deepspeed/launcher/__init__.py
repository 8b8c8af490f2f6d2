"""deepspeed.launcher: the `deepspeed` command is dslaunch (see runner.py)."""
