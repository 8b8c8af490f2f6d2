"""Session fixtures for the Hugging Face tests: the `deepspeed` compatibility package, built
and installed by `dslaunch install-deepspeed-compat --target DIR` (pip) into a private
folder, and a tiny GPT-2 on disk.

The package goes to a folder rather than into the suite's .venv, so no other test sees a
`deepspeed` module; DIR on PYTHONPATH gives the worker processes (and their child processes)
the same installed distribution (module, metadata, console script) that an install into
the environment gives.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest

@dataclass
class CompatInstall:
    target: Path

    def env(self, **extra: str) -> Dict[str, str]:
        """The current environment with the package importable and its `deepspeed` command on PATH."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.target), env.get("PYTHONPATH", "")) if p)
        env["PATH"] = os.pathsep.join((str(self.target / "bin"), os.path.dirname(sys.executable), env["PATH"]))
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def deepspeed_compat(tmp_path_factory) -> CompatInstall:
    target = tmp_path_factory.mktemp("deepspeed_compat")
    dslaunch = os.path.join(os.path.dirname(sys.executable), "dslaunch")
    res = subprocess.run([dslaunch, "install-deepspeed-compat", "--target", str(target)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return CompatInstall(target)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 (28k parameters, vocabulary 64) built from a config and saved with
    save_pretrained: what from_pretrained loads, with no hub access. Dropout is off so every
    run of it computes the same thing."""
    from transformers import GPT2Config, GPT2LMHeadModel
    import torch

    path = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def tiny_llama(vocab: int = 64, kv_heads: int = 2, attn: str = "sdpa", seed: int = 0):
    """The suite's tiny Llama (2 layers, hidden 32, 4 heads, untied embeddings), seeded: the
    model the tensor- and sequence-parallel tests shard and compare with one process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads,
                                        max_position_embeddings=32, tie_word_embeddings=False,
                                        attn_implementation=attn))
