"""deepspeed.runtime.config_utils (runtime/core/config/model_base.py) against DeepSpeed 0.19.8:
every case of scripts/config_model_cases.py (config models built on DeepSpeedConfigModel with
deprecated, aliased, nested and typed fields, and the module's helpers) gives the outcome
DeepSpeed recorded in tests/data/ds_config_model.json (scripts/make_ds_config_model_fixtures.py)."""
import importlib
import json
import logging

import pytest

import dslaunch.runtime  # noqa: F401  installs the alias table
from repo_paths import DATA
from script_modules import load_script

# deepspeed.runtime.config_utils, as `import dslaunch.runtime as deepspeed` scripts reach it
config_utils = importlib.import_module("dslaunch.runtime.config_utils")
DS = json.loads((DATA / "ds_config_model.json").read_text())
OURS = load_script("config_model_cases").run_all(config_utils)


def test_fixture_is_deepspeed_0198_and_covers_every_case():
    assert DS["deepspeed"] == "0.19.8"
    assert sorted(DS["cases"]) == sorted(OURS)


@pytest.mark.parametrize("case", sorted(DS["cases"]))
def test_case_matches_deepspeed(case):
    assert OURS[case] == DS["cases"][case]


def test_path_is_our_module():
    from dslaunch.runtime.core.config import model_base
    assert config_utils is model_base
    assert config_utils.DeepSpeedConfigModel.__module__ == "dslaunch.runtime.core.config.model_base"


def test_deprecated_key_warns_naming_its_replacement(caplog):
    from pydantic import Field

    class Conf(config_utils.DeepSpeedConfigModel):
        old: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "new"})
        new: int = 1

    with caplog.at_level(logging.WARNING, logger="dslaunch.runtime"):
        assert Conf(old=4).new == 4
    assert "old is deprecated; use new" in caplog.text


def test_new_param_fn_runs_only_on_a_given_value():
    """Better than DeepSpeed on purpose: its base also converts the default, so a converter
    that cannot take the default (int(None)) fails every build of the model."""
    from typing import Optional

    from pydantic import Field

    class Conf(config_utils.DeepSpeedConfigModel):
        old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                            "new_param_fn": int})
        new: int = 1

    assert Conf().new == 1
    assert Conf(old="3").new == 3
