"""Every rank's random-number-generator states, as plain values that weights_only loads.

numpy's state is kept as a dict of ints and a tensor (its own get_state() returns an
ndarray, which weights_only=True refuses), so a checkpoint never needs pickle for it.
"""
from __future__ import annotations

import random
import sys
from typing import Any, Dict

import torch


def rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, key, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"name": str(name), "key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        s = state["numpy"]
        np.random.set_state((s["name"], s["key"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))
