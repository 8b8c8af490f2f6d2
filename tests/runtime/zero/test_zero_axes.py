"""ZeRO strategies reduce each optimizer param group over its own mesh axis.

On 4 gloo ranks with a mesh of expert=2 (expert groups {0,1} {2,3}; expert-data groups
{0,2} {1,3}), a small model has a normal param group and a `"moe": True` group whose
parameters differ per expert rank. For stages 0, 1 and 2 the strategies, driven as the
engine drives them, must match a hand-computed reference: the normal group's gradients
averaged over all 4 ranks, the moe group's summed over its 2 expert-data replicas only and
divided by the 4 data-parallel ranks (DeepSpeed's averaging of expert gradients), the global
norm counting every parameter once (each expert once) and clipping with it. Without moe
groups the collectives, counted per process group, are exactly those of a strategy built
without a mesh. Stage 3, offload and checkpoints with such groups are one-line refusals.
"""
import pytest
import torch

from dist_harness import run_function

STEPS = 2
GAS = 2
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.05
TOL = 1e-5


class Net(torch.nn.Module):
    def __init__(self, expert_id: int):
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(4, 3)
        torch.manual_seed(100 + expert_id)  # each expert has its own weights
        self.expert = torch.nn.Linear(3, 2)

    def forward(self, x, y):
        return (self.expert(torch.tanh(self.shared(x))) - y).pow(2).mean()


def _batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)) for _ in range(STEPS * GAS)]


def _expert_of(rank):
    return rank % 2  # expert groups are consecutive ranks {0,1} {2,3}


def _param_groups(model, moe):
    return [{"params": list(model.shared.parameters())},
            {"params": list(model.expert.parameters()), "moe": moe, "name": "experts"}]


def _reference(world=4):
    """Every rank's training done by hand in one process: shared gradients averaged over
    all ranks, each expert's summed over the ranks holding it and divided by all ranks;
    norm over shared + every expert."""
    models = {e: Net(e) for e in (0, 1)}
    shared = list(models[0].shared.parameters())
    models[1].shared = models[0].shared  # one copy of the shared layer
    params = shared + [p for e in (0, 1) for p in models[e].expert.parameters()]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    data = {r: _batches(r) for r in range(world)}
    out = []
    for step in range(STEPS):
        grads = {id(p): torch.zeros_like(p) for p in params}
        for r in range(world):
            m = models[_expert_of(r)]
            for i in range(GAS):
                m.zero_grad()
                (m(*data[r][step * GAS + i]) / GAS).backward()
                for p in m.shared.parameters():
                    grads[id(p)] += p.grad / world
                for p in m.expert.parameters():
                    grads[id(p)] += p.grad / world
        norm = float(torch.sqrt(sum(g.pow(2).sum() for g in grads.values())))
        coef = min(1.0, CLIP / (norm + 1e-6))
        for p in params:
            p.grad = grads[id(p)] * coef
        opt.step()
        out.append({"norm": norm, "coef": coef,
                    "params": {e: {n: p.detach().clone() for n, p in models[e].named_parameters()} for e in (0, 1)}})
    return out


def _strategy(stage, model, moe, mesh, give_mesh=True, reduce_bucket=10, gather_bucket=6):
    """The stage's strategy as the engine builds it; give_mesh=False: without the mesh (the
    path every strategy took before param groups had axes)."""
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.strategy import StrategyContext, strategy_for_stage

    opt = torch.optim.SGD(_param_groups(model, moe), lr=LR, momentum=MOMENTUM)
    cfg = DeepSpeedConfig.load({"zero_optimization": {"stage": stage, "reduce_bucket_size": reduce_bucket,
                                                      "allgather_bucket_size": gather_bucket}})
    ctx = StrategyContext(module=model, optimizer=opt, config=cfg, device=torch.device("cpu"),
                          compute_dtype=torch.float32, rank=mesh.rank("data"), world_size=mesh.size("data"),
                          group=mesh.group("data"), mesh=mesh if give_mesh else None)
    z = strategy_for_stage(stage)(ctx)
    z.wrap_module()
    return z


def _train(stage, moe, mesh, rec, rank, give_mesh=True):
    model = Net(_expert_of(rank))
    z = _strategy(stage, model, moe, mesh, give_mesh)
    data = _batches(rank)
    mark = rec.mark()
    steps = []
    for step in range(STEPS):
        for i in range(GAS):
            boundary = i == GAS - 1
            loss = model(*data[step * GAS + i])
            z.before_backward(boundary)
            (loss / GAS).backward()
            z.after_backward(boundary)
        z.reduce_gradients()
        norm = z.global_grad_norm()
        z.scale_gradients_(min(1.0, CLIP / (norm + 1e-6)))
        z.optimizer_step()
        z.zero_grad()
        steps.append({"norm": norm, "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    calls = [(name, ranks) for name, ranks, _ in rec.since(mark)]
    z.close()
    return steps, calls


def _worker():
    import torch.distributed as dist

    from collectives import CollectiveRecorder
    from dslaunch.runtime.parallel import MeshDims, ProcessMesh
    from dslaunch.runtime.parallel.layout import topology_for

    rank = dist.get_rank()
    mesh = ProcessMesh(topology_for(MeshDims.for_world(4, expert=2)), expert=2)
    rec = CollectiveRecorder().install()
    out = {"axes": {a: mesh.ranks(a) for a in ("data", "expert", "expert_data")}, "moe": {}, "plain": {},
           "no_mesh": {}}
    for stage in (0, 1, 2):
        out["moe"][stage] = _train(stage, True, mesh, rec, rank)
        out["plain"][stage] = _train(stage, False, mesh, rec, rank)
        out["no_mesh"][stage] = _train(stage, False, mesh, rec, rank, give_mesh=False)
    rec.uninstall()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_function(_worker, nprocs=4, timeout=280)


@pytest.mark.timeout(300)
def test_mesh_axes_are_the_expected_groups(runs):
    for rank, r in enumerate(runs):
        assert r["axes"]["data"] == [0, 1, 2, 3]
        assert r["axes"]["expert"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["axes"]["expert_data"] == ([0, 2] if rank % 2 == 0 else [1, 3])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moe_group_averages_over_expert_data_and_norm_counts_each_expert_once(runs, stage):
    ref = _reference()
    assert any(s["coef"] < 1.0 for s in ref), "clipping must be active for the test to mean something"
    for rank, r in enumerate(runs):
        steps, _ = r["moe"][stage]
        for got, want in zip(steps, ref):
            assert got["norm"] == pytest.approx(want["norm"], rel=TOL), (rank, stage)
            expected = want["params"][_expert_of(rank)]
            for name, v in expected.items():
                assert torch.allclose(got["params"][name], v, rtol=TOL, atol=TOL), (rank, stage, name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_moe_collectives_run_on_their_axes(runs, stage):
    for rank, r in enumerate(runs):
        _, calls = r["moe"][stage]
        world, expert_data = (0, 1, 2, 3), tuple(r["axes"]["expert_data"])
        expert = tuple(r["axes"]["expert"])
        groups = {g for _, g in calls}
        assert world in groups and expert_data in groups, (rank, stage, groups)
        allowed = {world, expert_data} | ({expert} if stage == 0 else set())  # stage 0's norm sums experts
        assert groups <= allowed, (rank, stage, groups)
        if stage == 0:  # the norm: one all-reduce of the experts' squares per step
            assert [c for c in calls if c[1] == expert] == [("all_reduce", expert)] * STEPS
        else:  # every post-step all-gather of the expert group stays on its replicas
            gathers = {g for name, g in calls if name.startswith("all_gather")}
            assert gathers == {world, expert_data}, (rank, stage, gathers)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_default_groups_run_the_same_collectives_as_without_a_mesh(runs, stage):
    for rank, r in enumerate(runs):
        _, calls = r["plain"][stage]
        assert calls == r["no_mesh"][stage][1], (rank, stage)
        assert {g for _, g in calls} == {(0, 1, 2, 3)}
        if stage == 0:  # buckets of <= 10 elements in reverse order: [2, 6], [3], [12]
            assert calls == [("all_reduce", (0, 1, 2, 3))] * (3 * STEPS)
        # the same parameters averaged over all 4 ranks: the experts differ from the moe run
        assert not torch.allclose(r["plain"][stage][0][-1]["params"]["expert.weight"],
                                  r["moe"][stage][0][-1]["params"]["expert.weight"])


def _fake_mesh():
    from dslaunch.runtime.parallel import MeshDims, ProcessMesh
    from dslaunch.runtime.parallel.layout import topology_for

    return ProcessMesh(topology_for(MeshDims.for_world(4, expert=2)), expert=2, rank=0, world_size=4,
                       group_factory=tuple)


def _ctx(stage, zero_extra=None):
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.strategy import StrategyContext

    mesh = _fake_mesh()
    model = Net(0)
    opt = torch.optim.SGD(_param_groups(model, True), lr=LR)
    cfg = DeepSpeedConfig.load({"zero_optimization": {"stage": stage, **(zero_extra or {})}})
    return StrategyContext(module=model, optimizer=opt, config=cfg, device=torch.device("cpu"),
                           compute_dtype=torch.float32, rank=0, world_size=4, group=mesh.group("data"), mesh=mesh)


def test_axes_are_decided_from_the_moe_key():
    ctx = _ctx(1)
    assert [(a.name, a.size, a.rank, a.group) for a in ctx.axes] == [("data", 4, 0, (0, 1, 2, 3)),
                                                                     ("expert_data", 2, 0, (0, 2))]
    assert ctx.expert_axis().group == (0, 1)


def test_stage3_refuses_a_moe_group_in_one_line():
    from dslaunch.runtime.strategy import strategy_for_stage
    from dslaunch.runtime.strict import ConfigError

    with pytest.raises(ConfigError, match=r"^ZeRO stage 3: a param group reduces over the 'expert_data' axis "
                                          r"\(2 ranks, not the data-parallel group\)[^\n]*$"):
        strategy_for_stage(3)(_ctx(3))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_refuses_a_moe_group_in_one_line(device, tmp_path):
    from dslaunch.runtime.strategy import strategy_for_stage
    from dslaunch.runtime.strict import ConfigError

    ctx = _ctx(2, {"offload_optimizer": {"device": device, "nvme_path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=rf"^zero_optimization.offload_optimizer \({device}\): a param group "
                                          r"reduces over the 'expert_data' axis[^\n]*$"):
        strategy_for_stage(2)(ctx)
