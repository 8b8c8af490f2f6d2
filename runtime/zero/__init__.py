"""ZeRO stages 1-3 for dslaunch.runtime, selected by `zero_optimization.stage`.

Importing this package registers the stage strategies with the engine.
"""
from . import strategies  # noqa: F401  (registers stages 1 and 2)
