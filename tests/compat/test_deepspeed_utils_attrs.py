"""`deepspeed.utils.<submodule>` as an attribute of the compatibility package's deepspeed.utils
without importing it first (DeepSpeed's MoE tests read `deepspeed.utils.groups` so): the module of
dslaunch's alias table that `import deepspeed.utils.groups` gives, imported on first use; a
name with no entry is an absent attribute. A fresh interpreter, no ranks."""
import subprocess
import sys

CODE = """
import sys
import deepspeed
assert "deepspeed.utils.groups" not in sys.modules
from dslaunch.runtime.core.parallel import groups
assert deepspeed.utils.groups is groups
import deepspeed.utils.groups as again
assert again is groups
assert deepspeed.utils.timer is sys.modules["deepspeed.utils.timer"]
assert not hasattr(deepspeed.utils, "no_such_module")
assert not hasattr(deepspeed.utils, "_private")
print("ok")
"""


def test_utils_submodules_of_the_table_are_attributes(deepspeed_compat):
    res = subprocess.run([sys.executable, "-c", CODE], env=deepspeed_compat.env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "ok"
