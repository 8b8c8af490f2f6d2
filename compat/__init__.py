"""dslaunch.compat: opt-in compatibility distributions built from this repository.

compat/deepspeed/ is a separate distribution named "deepspeed" (its own pyproject.toml;
shipped inside dslaunch as package data) that serves DeepSpeed's Python API from
dslaunch.runtime; `dslaunch install-deepspeed-compat` (install.py) installs or removes it.

paths.py is the one table of DeepSpeed's module paths under dslaunch.runtime (and the runtime's
former ones): where each lives on the runtime's floors. dslaunch.runtime installs its finder on
import, so the table serves `import dslaunch.runtime as deepspeed` and the compatibility
package alike.
"""
