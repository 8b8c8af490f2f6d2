"""ZeRO on a data-parallel subgroup, through initialize(mpu=...): a 4-rank world run as two
independent data-parallel groups of 2 ({0, 1} and {2, 3}, each training on its own data).
In each group stages 1, 2 and 3 give the losses and weights of stage 0 (fp32, 1e-5), and
every collective each engine runs, counted per process group, stays inside its group.
Off the accumulation boundary stages 0 and 1 run no collective at all; stages 2 and 3
run only their gradient reductions / parameter gathers, on the group.

Also here: an mpu object that lacks a method is one clear error naming the methods."""
import pytest
import torch

from dist_harness import run_function

TOL = 1e-5
GAS = 2
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 9)
        self.out = torch.nn.Linear(9, 11)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


class PairMpu:
    """Megatron-style mpu: data-parallel pairs {0,1} / {2,3}; no tensor parallelism."""

    def __init__(self):
        import torch.distributed as dist

        self.pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        me = dist.get_rank()
        self.me = me
        self.single = dist.new_group([me], use_local_synchronization=True)

    def get_data_parallel_group(self):
        return self.pairs[self.me // 2]

    def get_data_parallel_rank(self):
        return self.me % 2

    def get_data_parallel_world_size(self):
        return 2

    def get_model_parallel_group(self):
        return self.single

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.3,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40,
                                  "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 40}}


def _train(stage, mpu, rec):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = Net()
    start = rec.mark()
    engine, _, _, _ = deepspeed.initialize(model=model, config=_config(stage), mpu=mpu)
    assert engine.train_batch_size() == 3 * GAS * 2  # micro x gas x data-parallel size, not world size
    group = dist.get_rank() // 2
    g = torch.Generator().manual_seed(100 + group)  # each group trains on its own data
    losses, off_boundary = [], []
    for step in range(STEPS):
        total = 0.0
        for i in range(GAS):
            x = torch.randint(0, 11, (2, 3, 4), generator=g)[engine.dp_rank]
            y = torch.randint(0, 11, (2, 3, 4), generator=g)[engine.dp_rank]
            mark = rec.mark()
            loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, 11), y.reshape(-1))
            engine.backward(loss)
            if i < GAS - 1:
                off_boundary += rec.since(mark)
            engine.step()
            total += float(loss) / GAS
        t = torch.tensor([total])
        dist.all_reduce(t, group=mpu.get_data_parallel_group())  # the test's own, not counted below
        losses.append(float(t) / 2)
    calls = rec.since(start)
    params = {n: v.float().clone() for n, v in engine.strategy.module_state_dict().items()}
    engine.destroy()
    return losses, params, calls, off_boundary


def _subgroup_worker():
    import torch.distributed as dist

    from collectives import CollectiveRecorder

    rec = CollectiveRecorder().install()
    mpu = PairMpu()
    mine = tuple(sorted(dist.get_process_group_ranks(mpu.get_data_parallel_group())))
    out = {}
    for stage in (0, 1, 2, 3):
        losses, params, calls, off = _train(stage, mpu, rec)
        # the test's own loss all-reduce runs on the pair too; everything is on the pair
        out[stage] = {"losses": losses, "params": params,
                      "groups": sorted({ranks for _, ranks, _ in calls}),
                      "ops": sorted({name for name, _, _ in calls}),
                      "off_boundary": [(n, r) for n, r, _ in off]}
    rec.uninstall()
    return {"pair": mine, "runs": out}


@pytest.mark.timeout(300)
def test_zero_stages_on_data_parallel_subgroups_equal_stage0_and_stay_in_their_group():
    results = run_function(_subgroup_worker, nprocs=4, timeout=280)
    for rank, r in enumerate(results):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert r["pair"] == pair
        ref = r["runs"][0]
        for stage in (0, 1, 2, 3):
            run = r["runs"][stage]
            assert run["groups"] == [pair], (rank, stage, run["groups"])
            assert run["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, stage)
            for name, v in ref["params"].items():
                assert torch.allclose(run["params"][name], v, rtol=TOL, atol=TOL), (rank, stage, name)
        assert r["runs"][0]["off_boundary"] == [] and r["runs"][1]["off_boundary"] == []
        for stage in (2, 3):
            off = r["runs"][stage]["off_boundary"]
            assert off and {g for _, g in off} == {pair}, (stage, off)
    # the two groups trained on different data: their models differ
    assert results[0]["runs"][1]["losses"] != results[2]["runs"][1]["losses"]
    # ranks of one group agree with each other
    assert results[0]["runs"][3]["losses"] == pytest.approx(results[1]["runs"][3]["losses"], rel=TOL)


def test_mpu_missing_methods_is_one_error():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.strict import ConfigError

    class Half:
        def get_data_parallel_group(self):
            return None

    with pytest.raises(ConfigError, match="the mpu object lacks get_model_parallel_rank"):
        deepspeed.initialize(model=Net(), config=_config(0), mpu=Half())
