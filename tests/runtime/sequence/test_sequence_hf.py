"""Ulysses through Hugging Face: register_with_transformers, the data loader adapter and
the sequence-parallel loss (deepspeed.runtime.sequence_parallel.ulysses_sp).

A tiny Llama built from a config (sdpa, grouped-query attention) trains at sp=2 on 2 gloo
ranks with the mpu register_with_transformers returns, and in one process over the whole
sequence on the same batches: the loss of every step and the weights after step 1 (SGD
with lr 1: the gradients themselves) must agree to 1e-5 in fp32. The labels are shifted
before slicing, so a slice's last token learns the next slice's first. A sequence length
that does not split, an attention implementation that cannot be wrapped, and AutoTP with the
mpu (which has no tensor axis; tp x sp is the engine's sequence_parallel_size) are one line.
"""
import pytest

from dist_harness import run_function
from hf_fixture import tiny_llama

SEQ, VOCAB, MICRO, BATCHES = 8, 64, 2, 4


def _batches(seq=SEQ):
    import torch

    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(BATCHES):
        ids = torch.randint(0, VOCAB, (MICRO, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train_body(sp, seq=SEQ, core="sdpa", tp=1):
    """Losses of every step and the flat weights after step 1."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.sequence import SequenceParallelError
    from dslaunch.runtime.strict import ConfigError
    from dslaunch.runtime.sequence_parallel.ulysses_sp import (UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter,
                                                                sequence_parallel_loss)

    model = tiny_llama(VOCAB)
    mpu = None
    try:
        if sp > 1:
            mpu = UlyssesSPAttentionHF.register_with_transformers(model, core, sequence_parallel_size=sp,
                                                                  micro_batch_size=MICRO, seq_length=seq,
                                                                  seq_length_is_variable=True)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_clipping": 1.0}
        if tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": tp}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                               config=cfg, mpu=mpu)
        batches = _batches(seq)
        if sp > 1:
            r = mpu.get_sequence_parallel_rank()
            dl = UlyssesSPDataLoaderAdapter(batches[r::sp], sp_rank=r, sp_group=mpu.get_sequence_parallel_group(),
                                            sp_world_size=sp, device=engine.device)
            assert len(dl) == BATCHES
        else:
            dl = batches
        losses, after_first = [], None
        for step, b in enumerate(dl):
            if sp > 1:
                out = engine(input_ids=b["input_ids"], labels=b["labels"], shift_labels=b["shift_labels"],
                             position_ids=b["position_ids"])
                loss = sequence_parallel_loss(out.loss, b["shift_labels"], mpu.get_sequence_parallel_group())
            else:
                loss = engine(input_ids=b["input_ids"], labels=b["labels"]).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            if step == 0:
                after_first = torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())]).tolist()
    except (SequenceParallelError, ConfigError) as exc:
        return str(exc)
    return losses, after_first


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


BAD = [(dict(sp=2, seq=7), "sequence length 7 does not split evenly over sequence parallel size 2"),
       (dict(sp=2, core="eager"), "core_attn_implementation 'eager' cannot be wrapped"),
       (dict(sp=3), "ulysses: sequence 3 does not divide world 2"),
       (dict(sp=2, tp=2), "tensor_parallel.autotp_size 2 with the mpu's sequence-parallel size 2 is not supported")]


def cases_body(cases):
    return [train_body(**kwargs) for kwargs in cases]


def test_hf_llama_sp2_equals_one_process_and_bad_input_is_one_line():
    """One 2-rank launch: the sp=2 run, then each bad input."""
    # the reference in a process of its own: its engine's process group must not outlive it here
    ref_losses, ref_weights = run_function(train_body, nprocs=1, timeout=240, kwargs=dict(sp=1))[0]
    results = run_function(cases_body, nprocs=2, timeout=240, kwargs=dict(cases=[dict(sp=2)] + [k for k, _ in BAD]))
    for rank, (good, *bad) in enumerate(results):
        losses, weights = good
        assert _close(losses, ref_losses), (rank, losses, ref_losses)
        assert _close(weights, ref_weights), rank  # SGD lr 1: the gradients of step 1
        for text, (_, message) in zip(bad, BAD):
            assert isinstance(text, str) and message in text and "\n" not in text, (text, message)


def test_uncaught_refusal_is_one_line_and_exit_2(tmp_path):
    """A script whose sequence-parallel layout cannot work stops with one line and exit 2."""
    import os
    import subprocess
    import sys

    script = tmp_path / "bad_sp.py"
    script.write_text(
        "import dslaunch.runtime as deepspeed\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from dslaunch.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,\n"
        "                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))\n"
        "UlyssesSPAttentionHF.register_with_transformers(model, 'sdpa', 2, 1)\n")
    # a fresh single process, without the rendezvous variables of the job running pytest, if any
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == ["error: ulysses: sequence 2 does not divide world 1"], res.stderr


def test_ulysses_attention_checks_layers_and_heads_against_registration():
    """The shapes DeepSpeed's constructor takes are checked: a layer index at or past
    num_hidden_layers, and (fixed length) a head count that differs, are one-line errors."""
    import torch

    from dslaunch.runtime.sequence import SequenceParallelError
    from dslaunch.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    attn = UlyssesSPAttentionHF(None, batch_size=2, attn_head_count=4, attn_head_size=8, kv_head_count=2,
                                num_hidden_layers=2, process_group=None, seq_length_is_variable=False,
                                global_seq_length=16)
    layer = torch.nn.Module()
    q, k = torch.zeros(2, 4, 8, 8), torch.zeros(2, 2, 8, 8)
    layer.layer_idx = 1
    attn._check(layer, q, k, sp=2)  # consistent: no error
    layer.layer_idx = 2
    with pytest.raises(SequenceParallelError, match="attention layer 2 is past the num_hidden_layers 2"):
        attn._check(layer, q, k, sp=2)
    layer.layer_idx = 0
    with pytest.raises(SequenceParallelError, match="key/value head count 4 differs from the 2"):
        attn._check(layer, q, torch.zeros(2, 4, 8, 8), sp=2)
