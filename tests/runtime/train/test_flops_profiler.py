"""flops_profiler: FLOPs/MACs per module counted by torch.utils.flop_counter, params,
latency and achieved FLOP/s, through get_model_profile and at the engine's profile_step."""
import re

import torch

from dist_harness import run_function

from dslaunch.runtime.profiling.flops_profiler import FlopsProfiler, get_model_profile


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(128, 10))
        self.conv = torch.nn.Conv1d(1, 4, kernel_size=3)

    def forward(self, x):
        y = self.b(self.a(x))
        return y.sum() + self.conv(x[:, None, :]).sum()


LINEAR_FLOPS = 2 * (32 * 64 * 128 + 32 * 128 * 10)
CONV_FLOPS = 2 * 32 * 4 * 62 * 3  # out positions x kernel x 2


def test_get_model_profile_counts_with_torch_and_formats_like_deepspeed(tmp_path, capsys):
    model = Net()
    flops, macs, params = get_model_profile(model, input_shape=(32, 64), as_string=False, print_profile=False)
    assert flops == LINEAR_FLOPS + CONV_FLOPS and macs == flops // 2
    assert params == sum(p.numel() for p in model.parameters())
    as_text = get_model_profile(model, input_shape=(32, 64), print_profile=False)
    assert as_text == ("653.82 K", "326.91 KMACs", "9.63 K")  # 606208 + 47616 FLOPs
    out = tmp_path / "profile.txt"
    get_model_profile(model, args=[torch.randn(32, 64)], module_depth=1, top_modules=2, output_file=str(out))
    text = out.read_text()
    assert capsys.readouterr().out == ""  # written to the file, not printed
    assert "fwd FLOPs per rank:  653.82 KFLOPs" in text and "top 2 modules" in text
    assert re.search(r"^  a \(Linear\): 8\.32 K = 86\.\d+% params, 262\.14 KMACs = \d+\.\d+% MACs, .* latency, "
                     r"[\d.]+ [KMG]?FLOPS$", text, re.M), text
    assert "    1 (Linear)" not in text  # module_depth 1 stops the tree at depth 1
    detailed_off = get_model_profile(model, input_shape=(32, 64), detailed=False, as_string=False)
    assert detailed_off[0] == flops and "per module:" not in capsys.readouterr().out


def test_profiler_tree_latency_and_per_module_flops():
    model = Net()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(32, 64))
    prof.stop_profile()
    tree = prof.tree()
    by_name = {c.name: c for c in tree.children}
    assert by_name["a"].flops == 2 * 32 * 64 * 128 and by_name["conv"].flops == CONV_FLOPS
    assert by_name["b"].children[1].flops == 2 * 32 * 128 * 10 and by_name["b"].children[0].flops == 0
    assert all(n.latency > 0 and n.calls == 1 for n in tree.children)
    assert prof.get_total_duration() >= by_name["a"].latency
    prof.end_profile()
    assert prof.get_total_flops() == 0


def _engine_profile(out):
    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": -1, "top_modules": 2,
                              "detailed": True, "output_file": out}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(8):
        loss = engine(torch.randn(8, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine.config.wall_clock_breakdown, engine.progress.breakdown


def test_engine_profiles_the_configured_step(tmp_path):
    out = tmp_path / "flops.txt"
    assert run_function(_engine_profile, nprocs=1, kwargs={"out": str(out)}, timeout=120)[0] == (False, True)
    text = out.read_text()
    assert text.count("flops profile at step 2") == 1
    per_batch = 2 * 8 * (16 * 64 + 64 * 4)
    assert f"fwd FLOPs per rank:" in text and f"{per_batch * 2 / 1000:g} KFLOPs" in text  # both micro-batches
    assert "batch size per rank 16" in text
    for key in ("fwd latency", "bwd latency", "step latency", "iter latency", "samples/s",
                "fwd+bwd FLOP/s per rank (3 x fwd FLOPs / fwd+bwd latency)"):
        assert key in text
    assert re.search(r"^  0 \(Linear\): 1\.09 K = ", text, re.M), text
