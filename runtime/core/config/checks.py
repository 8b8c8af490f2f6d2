"""Small value checks shared by the config sections."""
from __future__ import annotations

from ..strict import ConfigError


def positive(path: str, key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path + '.' if path else ''}{key}: must be {bound}, got {value}")


def within(path: str, key: str, value, low, high) -> None:
    if value is not None and not (low <= value <= high):
        raise ConfigError(f"{path + '.' if path else ''}{key}: must be between {low} and {high}, got {value}")
