"""Tiled compute over the sequence (deepspeed.runtime.sequence_parallel.ulysses_sp's TiledMLP,
SequenceTiledCompute / sequence_tiled_compute, TiledFusedLogitsLoss, and tiled_causal_lm_loss):
outputs and gradients equal the untiled computation, including shard counts that do not divide
the length; equal real DeepSpeed 0.19.8's on the same inputs (tests/data/ds_tiled, from
scripts/make_ds_tiled_fixtures.py); and inside the engine (Ulysses sp=2, ZeRO 0/2/3) training
equals one process over the whole sequence, untiled."""
import json
import os

import pytest
import torch

import tiled_workload as tw
from dist_harness import run_function
from dslaunch.runtime.sequence_parallel import ulysses_sp as usp
from dslaunch.runtime.sequence_parallel.tiled import shift_labels_of
import repo_paths

HERE = str(repo_paths.TESTS)
FIXTURE = os.path.join(HERE, "data", "ds_tiled", "expected.json")


def _same(got, want, tol=1e-6):
    """Every output and gradient within tol (relative to the larger of 1 and the value)."""
    assert set(got["grads"]) == set(want["grads"])
    pairs = [("out", got["out"], want["out"])] + [(k, got["grads"][k], want["grads"][k]) for k in want["grads"]]
    for name, a, b in pairs:
        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
        assert a.shape == b.shape, name
        err = ((a - b).abs() / b.abs().clamp(min=1)).max().item()
        assert err < tol, (name, err)


def test_matches_deepspeed_0_19_8():
    fixture = json.load(open(FIXTURE))
    assert fixture["deepspeed"] == "0.19.8" and set(fixture["cases"]) == set(tw.CASES)
    for name, want in fixture["cases"].items():
        _same(tw.run_case(usp, name), want)
    # where DeepSpeed's gradients are wrong, dslaunch's equal the untiled ones
    assert set(fixture["differs"]) == set(tw.DIFFERS)
    for name, deepspeed in fixture["differs"].items():
        untiled = tw.run_case(usp, name, tiled=False)
        _same(tw.run_case(usp, name), untiled)
        with pytest.raises(AssertionError):
            _same(deepspeed, untiled)


@pytest.mark.parametrize("shards", [1, 3, 4, 16])  # of 10 tokens: 4 gives 3, 3, 3, 1; 16 gives 10 of one
def test_mlp_and_sequence_compute_equal_untiled(shards):
    _same(tw.run_mlp(usp, shards), tw.run_mlp(usp, shards, tiled=False))
    _same(tw.run_sequence_compute(usp, shards), tw.run_sequence_compute(usp, shards, tiled=False))


@pytest.mark.parametrize("kind", sorted(tw.LOSSES))
@pytest.mark.parametrize("shards", [1, 3, 4, 6])  # of 20 rows: 7, 7, 6 and 4 x 5 (5 slices for 6)
def test_fused_logits_loss_equals_untiled(kind, shards):
    _same(tw.run_loss(usp, kind, shards), tw.run_loss(usp, kind, shards, tiled=False))


def test_mlp_under_a_batch_and_seq_transposed_and_2d():
    """x [s, h] (MoE experts' layout), and a non-contiguous x, tiled along dim -2."""
    mlp = tw.make_mlp(0)
    for x in (torch.randn(11, tw.HIDDEN), torch.randn(tw.HIDDEN, 3, 9).permute(1, 2, 0)):
        x.requires_grad_(True)
        up = torch.randn(x.shape)
        mlp(x).backward(up)
        want = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        out = usp.TiledMLP.apply(tw.mlp_forward, mlp, x, 4, None)  # self's parameters found without the list
        torch.testing.assert_close(out, mlp(x), rtol=1e-6, atol=1e-6)
        out.backward(up)
        for a, b in zip([x.grad] + [p.grad for p in mlp.parameters()], want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        mlp.zero_grad(set_to_none=True)


def test_sequence_compute_loss_form_mean():
    """One scalar per slice (output_unshard_dimension 0), "mean": the mean of the slices' losses
    (11 tokens in slices of 3, 3, 3, 2); the labels are sharded along and get no gradient."""
    head = tw.make_head(2)
    x, _, labels, _ = tw.inputs(1, seq=11)

    def fn(x, y):
        return tw.loss_sum(head, x, y)

    loss = usp.sequence_tiled_compute(fn, 11, 4, {"x": x, "y": labels}, {}, "x", list(head.parameters()),
                                      output_unshard_dimension=0, output_reduction="mean")
    (loss * 3).backward()
    got = [loss.detach(), x.grad.clone(), head.weight.grad.clone()]
    x.grad, head.weight.grad = None, None
    want = torch.stack([fn(x[:, lo:lo + 3], labels[:, lo:lo + 3]) for lo in range(0, 11, 3)]).mean()
    (want * 3).backward()
    for a, b in zip(got, [want.detach(), x.grad, head.weight.grad]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sequence_compute_defaults_mean_over_every_element():
    """The defaults (output_unshard_dimension 1, "mean"): the mean of the concatenated output,
    with its gradient 1 / elements (DeepSpeed 0.19.8's backward fails here: narrow() of a 0-dim
    gradient)."""
    mlp = tw.make_mlp(0)
    x, _, _, _ = tw.inputs(1)
    out = usp.sequence_tiled_compute(lambda x: mlp(x), tw.SEQ, 4, {"x": x}, {}, "x", list(mlp.parameters()))
    out.backward()
    got = [out.detach(), x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    want = mlp(x).mean()
    want.backward()
    for a, b in zip(got, [want.detach(), x.grad] + [p.grad for p in mlp.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _lm_loss_reference(head, x, labels):
    logits = head(x).float()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(logits.view(-1, tw.VOCAB), shift.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_tiled_causal_lm_loss_is_the_mean_over_labelled_tokens(shards):
    """labels shifted here, or shift_labels given; unevenly labelled slices; the weight
    gradients follow a scaled loss (gradient accumulation, loss scaling)."""
    head = tw.make_head(2)
    x, _, labels, _ = tw.inputs(1, seq=13)
    want = _lm_loss_reference(head, x, labels)
    (0.25 * want).backward()
    ref = [want.detach(), x.grad.clone(), head.weight.grad.clone()]
    for kw in ({"labels": labels}, {"shift_labels": shift_labels_of(labels)}):
        x.grad, head.weight.grad = None, None
        loss = usp.tiled_causal_lm_loss(x, head, shards, **kw)
        (0.25 * loss).backward()
        for a, b in zip([loss.detach(), x.grad, head.weight.grad], ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # evaluation: no gradients kept
        torch.testing.assert_close(usp.tiled_causal_lm_loss(x, head, shards, labels=labels), ref[0])


def test_bad_input_is_one_line():
    mlp, head = tw.make_mlp(0), tw.make_head(2)
    x, _, labels, _ = tw.inputs(1)
    extra = torch.nn.Parameter(torch.ones(tw.HIDDEN))
    out = usp.TiledMLP.apply(lambda self, x: self(x) * extra, mlp, x, 2, list(mlp.parameters()))
    cases = [
        (lambda: out.sum().backward(), "TiledMLP: the function uses a trainable tensor that is neither"),
        (lambda: usp.TiledFusedLogitsLoss.apply(lambda self, x, y: tw.loss_sum(self, x * extra, y), head, x, labels,
                                                None, 2, None, "sum"), "TiledFusedLogitsLoss: the function uses"),
        (lambda: usp.TiledMLP.apply(tw.mlp_forward, mlp, x, 0, None), "shards must be a positive int, not 0"),
        (lambda: usp.TiledFusedLogitsLoss.apply(tw.loss_sum, head, x, labels, None, 2, None, "avg"),
         "output_reduction must be 'mean' or 'sum', not 'avg'"),
        (lambda: usp.TiledFusedLogitsLoss.apply(tw.loss_sum, head, x, labels[:, :4], None, 2, None, "sum"),
         "x and y must be [batch, seq, ...] with the same batch and seq"),
        (lambda: usp.sequence_tiled_compute(lambda x, p: x * p, tw.SEQ, 2, {"x": x}, {"p": extra * 2}, "x"),
         "'p' requires grad, but only grad_requiring_tensor_key ('x') gets a gradient"),
        (lambda: usp.sequence_tiled_compute(lambda x: x, tw.SEQ, 2, {"x": x}, {}, "y"),
         "grad_requiring_tensor_key 'y' is not one of the sharded keys"),
        (lambda: usp.tiled_causal_lm_loss(x, head, 2), "give labels or shift_labels, one of them"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value), (message, str(info.value))


# -- inside the engine: Ulysses sp=2, ZeRO 0/2/3 ----------------------------------------------
SEQ, ROWS, STEPS = 12, 2, 3


def _net():
    torch.manual_seed(3)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(tw.VOCAB, tw.HIDDEN)
            self.mlp = tw.make_mlp(4)
            self.head = torch.nn.Linear(tw.HIDDEN, tw.VOCAB, bias=False)
            self.tiled = False

        def forward(self, tokens):
            x = self.emb(tokens)
            if self.tiled:
                return x + usp.TiledMLP.apply(tw.mlp_forward, self.mlp, x, 3, list(self.mlp.parameters()))
            return x + self.mlp(x)

    return Net()


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    tokens = torch.randint(0, tw.VOCAB, (ROWS, SEQ), generator=g)
    labels = tokens.clone()
    labels[0, : 2 + step] = -100  # unevenly labelled slices
    return tokens, labels


def engine_body(stages):
    """Train at sp=2 with TiledMLP and tiled_causal_lm_loss under each ZeRO stage, and one
    process untiled over the whole sequence (plain torch, in this process); return the losses
    and the largest weight difference (stages 0-2 keep whole weights)."""
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    ref_losses = []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        loss = _lm_loss_reference(net.head, net(tokens), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss))
    ref_weights = {n: p.detach().clone() for n, p in net.named_parameters()}
    out = {"ref": ref_losses}
    for stage in stages:
        net = _net()
        net.tiled = True
        cfg = {"train_micro_batch_size_per_gpu": ROWS, "sequence_parallel_size": 2, "steps_per_print": 1000,
               "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 64},
               "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                                               config=cfg)
        group = engine.seq_parallel_group
        r, chunk = comm.get_rank(group), SEQ // 2
        losses = []
        for step in range(STEPS):
            tokens, labels = _batch(step)
            shift = shift_labels_of(labels)
            hidden = engine(tokens[:, r * chunk:(r + 1) * chunk])
            loss = usp.tiled_causal_lm_loss(hidden, net.head, 2, shift_labels=shift[:, r * chunk:(r + 1) * chunk],
                                            group=group)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        diff = None
        if stage < 3:
            diff = max((p.detach() - ref_weights[n]).abs().max().item() for n, p in net.named_parameters())
        out[stage] = (losses, diff)
    return out


def test_engine_sp2_zero_stages_equal_one_process_untiled():
    results = run_function(engine_body, nprocs=2, timeout=240, env={"PYTHONPATH": HERE},
                           kwargs=dict(stages=[0, 2, 3]))
    for out in results:
        for stage in (0, 2, 3):
            losses, diff = out[stage]
            assert max(abs(a - b) for a, b in zip(losses, out["ref"])) < 1e-5, (stage, losses, out["ref"])
            assert diff is None or diff < 1e-5, (stage, diff)


def test_hf_llama_with_tiled_mlp_and_loss_equals_untiled():
    """A tiny Hugging Face Llama, each LlamaMLP's forward through TiledMLP (DeepSpeed's
    documented use) and the loss through tiled_causal_lm_loss: the loss and every gradient equal
    the untouched model's own loss (labels shifted by transformers), 13 tokens in 3 slices."""
    import types

    from hf_fixture import tiny_llama

    model = tiny_llama(64)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, :4] = -100
    want = model(input_ids=ids, labels=labels).loss
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    def tiled_forward(self, x):
        return usp.TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)), self, x, 3,
                                  [m.weight for m in (self.gate_proj, self.up_proj, self.down_proj)])

    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(tiled_forward, layer.mlp)
    hidden = model.model(input_ids=ids).last_hidden_state
    loss = usp.tiled_causal_lm_loss(hidden, model.lm_head, 3, labels=labels)
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6, msg=n)



def test_forward_keeps_only_the_input_for_backward():
    """What autograd holds between forward and backward (saved-tensor hooks): the untiled MLP its
    [b, s, 4h]-sized intermediates, TiledMLP x alone; the tiled loss nothing of the logits (its
    gradients, x's and the head's, are all it keeps). The measured peaks: scripts/bench_sp.py --tiled."""
    mlp, head = tw.make_mlp(0), tw.make_head(2)
    x, _, labels, _ = tw.inputs(1, seq=64)
    live = [0]

    class Held:  # a saved tensor, counted while the graph keeps it
        def __init__(self, t):
            self.t, self.n = t, t.numel() * t.element_size()
            live[0] += self.n

        def __del__(self):
            live[0] -= self.n

    def held(fn):
        before = live[0]
        with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
            out = fn()  # the graph lives as long as its output
        n = live[0] - before
        del out
        return n

    x_bytes = x.numel() * x.element_size()
    assert held(lambda: mlp(x)) > 4 * x_bytes
    assert held(lambda: usp.TiledMLP.apply(tw.mlp_forward, mlp, x, 8, list(mlp.parameters()))) == x_bytes
    assert held(lambda: _lm_loss_reference(head, x, labels)) >= 2 * x.shape[0] * x.shape[1] * tw.VOCAB * 4
    assert held(lambda: usp.tiled_causal_lm_loss(x, head, 8, labels=labels)) < x_bytes
