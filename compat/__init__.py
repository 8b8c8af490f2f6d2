"""dslaunch.compat: opt-in compatibility distributions built from this repository.

compat/deepspeed/ is a separate distribution named "deepspeed" (its own pyproject.toml;
shipped inside dslaunch as package data) that serves DeepSpeed's Python API from
dslaunch.runtime; `dslaunch install-deepspeed-compat` (install.py) installs or removes it.
"""
