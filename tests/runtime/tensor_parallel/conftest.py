"""Fixtures shared by the AutoTP layer tests of this folder."""
import importlib

import pytest

mode = importlib.import_module("dslaunch.runtime.tensor_parallel.mode")


@pytest.fixture
def training_mode():
    """AutoTP's process-wide training switch on for one test, and put back as it was."""
    was = mode.is_autotp_training_mode()
    mode.set_autotp_mode(training=True)
    yield
    mode.set_autotp_mode(training=was)
