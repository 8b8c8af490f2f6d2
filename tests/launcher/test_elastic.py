"""Elastic jobs without a cluster: the pure parts (bounds, re-planning, accumulation, valid
sizes, sample offsets, messages), the runtime's driver in one process against a fake node
agent, and the node agent's side of the workers' socket. The cluster tests
(test_elastic_cluster.py) run the whole thing across hosts."""
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from dslaunch.launcher import elastic
from dslaunch.launcher.elastic import ElasticSpec, Facts, choose_hosts, resolve_spec, resume_clause, why_no_choice
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.dataloader import DistributedDataLoader, ResumableSampler
from dslaunch.runtime.train.resize import batch as rbatch
from dslaunch.runtime.train.resize import contract
from dslaunch.runtime.train.resize_driver import next_save, stale_tags
from dslaunch.runtime.strict import ConfigError
import repo_paths


# ------------------------------------------------------------------------ the launcher's arithmetic

def test_the_contract_names_agree_on_both_sides():
    for name in ("SAVE_DIR_VAR", "SAVE_EVERY_VAR", "BASE_WORLD_VAR", "MAX_WORLD_VAR", "AGENT_SOCKET_VAR",
                 "RESIZE_EXIT_CODE"):
        assert getattr(elastic, name) == getattr(contract, name)


def test_bounds_and_their_refusals():
    assert resolve_spec(None, None, 3) is None
    assert resolve_spec(2, None, 3) == ElasticSpec(2, 3)
    assert resolve_spec(None, 2, 3) == ElasticSpec(1, 2)
    assert elastic.parse_nnodes("1:4") == (1, 4)
    for args, message in [((4, None, 3), "--min_nodes 4: the hostfile lists only 3 host(s)"),
                          ((1, 5, 3), "--max_nodes 5: the hostfile lists only 3 host(s)"),
                          ((3, 2, 3), "--min_nodes 3 is above --max_nodes 2"),
                          ((0, None, 3), "--min_nodes 0: must be at least 1")]:
        with pytest.raises(LaunchConfigError, match=re.escape(message)):
            resolve_spec(*args)
    with pytest.raises(LaunchConfigError, match="--num_nodes cannot be combined"):
        resolve_spec(2, None, 3, num_nodes=2)
    with pytest.raises(LaunchConfigError, match=r"--nnodes: dslaunch starts every node from one machine"):
        elastic.parse_nnodes("2")
    with pytest.raises(LaunchConfigError, match=r"--nnodes a:b: expected MIN:MAX"):
        elastic.parse_nnodes("a:b")


def test_the_cli_spellings_reach_the_same_options(tmp_path):
    from click.testing import CliRunner

    from dslaunch.launcher.cli import launch

    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\nc slots=2\n")
    (tmp_path / "t.py").write_text("")

    def plan(*args, env=None):
        r = CliRunner().invoke(launch, ["-H", str(tmp_path / "hosts"), "--dry_run", "--json", *args, str(tmp_path / "t.py")],
                               prog_name="dslaunch", env=env)
        return r.exit_code, (json.loads(r.stdout) if r.exit_code == 0 else r.stderr)

    for args in (["--min_nodes", "2", "--max_nodes", "3"], ["--nnodes", "2:3"],
                 ["--elastic_training", "--min_elastic_nodes", "2", "--max_elastic_nodes", "3"]):
        code, d = plan(*args)
        assert code == 0, d
        assert d["elastic"]["min_nodes"] == 2 and d["elastic"]["max_nodes"] == 3 and d["num_nodes"] == 3
    code, d = plan("--elastic_training", "--max_nodes", "2", "--checkpoint_dir", "ck", "--checkpoint_every", "5")
    env = d["nodes"][0]["workers"][0]["env"]
    assert d["num_nodes"] == 2 and d["elastic"]["min_nodes"] == 1
    assert env["DSLAUNCH_SAVE_DIR"] == str(tmp_path / "ck") or env["DSLAUNCH_SAVE_DIR"].endswith("/ck")
    assert (env["DSLAUNCH_SAVE_EVERY"], env["DSLAUNCH_BASE_WORLD_SIZE"], env["DSLAUNCH_MAX_WORLD_SIZE"]) == ("5", "4", "4")
    code, d = plan(env={"DSLAUNCH_MIN_NODES": "2", "DSLAUNCH_CHECKPOINT_DIR": "/ck", "DSLAUNCH_CHECKPOINT_EVERY": "7"})
    assert code == 0 and d["elastic"] == {"min_nodes": 2, "max_nodes": 3, "checkpoint_dir": "/ck", "checkpoint_every": 7}
    code, err = plan("--nnodes", "1:3", "--min_nodes", "2")
    assert code == 2 and "--nnodes 1:3 and --min_nodes 2 disagree" in err
    code, err = plan("--min_nodes", "2", "--launcher", "pdsh")
    assert code == 2 and "elastic jobs run with --launcher ssh" in err
    code, err = plan("--checkpoint_every", "0", "--checkpoint_dir", "x")
    assert code == 2 and "--checkpoint_every 0: must be 1 or more steps" in err


def test_choose_hosts_takes_the_most_hosts_whose_world_the_batch_allows():
    slots = {"a": 2, "b": 2, "c": 2, "d": 1}
    spec = ElasticSpec(1, 3)
    anything = Facts({})
    assert choose_hosts(["a", "b", "c", "d"], slots, spec, anything).hosts == ("a", "b", "c")
    # global batch 12, micro 1: 6 and 4 ranks split it, 5 does not
    facts = Facts({w: (1, 12 // w) for w in (1, 2, 3, 4, 6, 12)})
    assert choose_hosts(["a", "b", "c"], slots, spec, facts).world == 6
    assert choose_hosts(["a", "d", "b"], slots, spec, facts).hosts == ("a", "d")  # 5 ranks cannot: 3 can
    assert choose_hosts(["a"], slots, ElasticSpec(2, 3), facts) is None
    assert why_no_choice(["a"], slots, ElasticSpec(2, 3), facts) == "1 host(s) left, below --min_nodes 2"
    only_six = Facts({6: (1, 2)})  # an elasticity section's list
    assert choose_hosts(["a", "b"], slots, ElasticSpec(2, 3), only_six) is None
    assert why_no_choice(["a", "b"], slots, ElasticSpec(2, 3), only_six) == (
        "the batch allows no world size of 4 rank(s) on the hosts left (the config's elasticity section allows "
        "world sizes 6)")
    assert Facts.from_report({"sizes": {"4": [1, 3], "6": [1, 2], "x": "y"}}).sizes == {4: (1, 3), 6: (1, 2)}
    # the rule the runtime reports without an elasticity section: batch 12 of micro 2, pipeline x 2
    rule = Facts.from_report({"batch": 12, "micro": 2, "model": 2})
    assert [w for w in range(1, 13) if rule.allows(w)] == [2, 4, 6, 12]
    assert (rule.accumulation(4), rule.accumulation(12), rule.accumulation(8)) == (3, 1, None)
    assert choose_hosts(["a", "b", "d"], slots, spec, rule).hosts == ("a", "b")
    assert "the global batch 12 must split into micro batches of 2 per data rank (model-parallel degree 2)" in \
        why_no_choice(["d"], slots, ElasticSpec(1, 1), rule)
    assert Facts.from_report({"batch": "x"}) == Facts({})


def test_messages():
    assert resume_clause(3, 4, 1200, True, (4, 6)) == "resuming on 3 of 4 hosts from step 1,200, accumulation 4 -> 6"
    assert resume_clause(2, 2, None, True, (2, 2)) == "resuming on 2 of 2 hosts from the start (no checkpoint yet)"
    assert "from the script's own checkpoint" in resume_clause(1, 2, None, False, (None, None))
    assert elastic.lost_reason("lost: nothing from its agent for 10s (--heartbeat_timeout 10; ...)") == \
        "no heartbeat for 10 s"
    assert elastic.lost_reason("lost its node agent (the connection dropped)") == "its agent's connection dropped"
    assert elastic.steps(1240) == "1,240" and elastic.steps(None) == "?"
    assert [elastic.backoff(n, 2.0) for n in range(3)] == [2.0, 4.0, 8.0] and elastic.backoff(20, 2.0) == 300.0
    assert elastic.in_order(["c", "a", "x"], ["a", "b", "c"]) == ["a", "c", "x"]


# ------------------------------------------------------------------------ the runtime's arithmetic

def cfg(**keys):
    base = {"optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    return DeepSpeedConfig.load({**base, **keys})


def test_accumulation_grows_as_data_ranks_shrink():
    c = cfg(train_batch_size=12, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    sizes = {dp: rbatch.batch_sizes(c, dp, "test", dp, 6) for dp in (6, 4, 3, 1)}
    assert {dp: (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)
            for dp, b in sizes.items()} == {6: (12, 1, 2), 4: (12, 1, 3), 3: (12, 1, 4), 1: (12, 1, 12)}
    with pytest.raises(ConfigError, match="does not split into micro batches of 1 over 5"):
        rbatch.batch_sizes(c, 5, "test", 5, 6)
    # without a base world the config is resolved as always (and 12 != 1 x 2 x 4 is its usual error)
    with pytest.raises(ConfigError, match="train_batch_size 12 != 1 x 2 x 4"):
        rbatch.batch_sizes(c, 4, "test", 4, None)
    # micro batch and accumulation only: the global batch is theirs at the configured size
    c2 = cfg(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    assert rbatch.batch_sizes(c2, 2, "test", 2, 4).gradient_accumulation_steps == 2
    # pipeline x 2: world 8 is 4 data ranks; the configured world 12 is 6
    assert rbatch.batch_sizes(c, 4, "test", 8, 12).gradient_accumulation_steps == 3
    with pytest.raises(ConfigError, match="not a multiple of the model-parallel degree 2"):
        rbatch.batch_sizes(c, 2, "test", 4, 5)


def test_world_table_lists_the_sizes_that_split_the_batch():
    c = cfg(train_batch_size=12, train_micro_batch_size_per_gpu=1)
    assert rbatch.world_table(c, 6, 6, 6, 8) == {1: (1, 12), 2: (1, 6), 3: (1, 4), 4: (1, 3), 6: (1, 2)}
    assert rbatch.world_table(c, 4, 2, 8, 8) == {2: (1, 12), 4: (1, 6), 6: (1, 4), 8: (1, 3)}  # pipeline x 2


def test_the_elasticity_section_decides_when_given():
    c = cfg(elasticity={"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3],
                        "min_gpus": 1, "max_gpus": 8, "version": 0.1})
    from dslaunch.runtime.elasticity import elastic_batch

    batch, valid = elastic_batch(c.elasticity)
    table = rbatch.world_table(c, 4, 4, 4, 8)
    assert sorted(table) == [w for w in valid if w <= 8]
    for w, (micro, gas) in table.items():
        assert micro * gas * w == batch
    invalid = next(w for w in range(1, 9) if w not in valid)
    with pytest.raises(ConfigError, match=f"world size {invalid} is not one of the valid GPU counts"):
        rbatch.batch_sizes(c, invalid, "test", invalid, 4)


def test_resize_env_is_checked():
    assert not contract.ResizeEnv.from_environ({}).active
    env = contract.ResizeEnv.from_environ({"DSLAUNCH_SAVE_DIR": "/x", "DSLAUNCH_SAVE_EVERY": "5",
                                           "DSLAUNCH_BASE_WORLD_SIZE": "6", "DSLAUNCH_AGENT_SOCKET": "@a"})
    assert (env.save_dir, env.save_every, env.base_world, env.agent_socket) == ("/x", 5, 6, "@a")
    with pytest.raises(ConfigError, match=r"\$DSLAUNCH_SAVE_EVERY='x': expected a whole number"):
        contract.ResizeEnv.from_environ({"DSLAUNCH_SAVE_DIR": "/x", "DSLAUNCH_SAVE_EVERY": "x"})
    with pytest.raises(ConfigError, match=r"\$DSLAUNCH_SAVE_EVERY=5: needs \$DSLAUNCH_SAVE_DIR"):
        contract.ResizeEnv.from_environ({"DSLAUNCH_SAVE_EVERY": "5"})


def test_stale_tags_and_next_save():
    names = ["latest", "global_step4", "global_step12", "global_step8", "mine", "global_stepx"]
    assert stale_tags(names) == ["global_step4"]
    assert stale_tags(names, keep=1) == ["global_step4", "global_step8"]
    assert (next_save(9, 4), next_save(12, 4), next_save(9, None)) == (12, 12, 9)


# ------------------------------------------------------------------------ sample offsets

@pytest.mark.parametrize("shuffle", [True, False])
def test_the_sampler_at_start_0_is_distributed_sampler(shuffle):
    data = TensorDataset(torch.arange(23))
    for world in (1, 3, 4):
        for rank in range(world):
            ours = ResumableSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5)
            theirs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5)
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def step_samples(world, micro, gas, steps, start_world=None, resume_after=None):
    """The sample ids of each optimizer step, loaders on `world` ranks; with resume_after=k,
    the first k steps run on start_world ranks, then every rank resumes from a checkpoint."""
    data = TensorDataset(torch.arange(240))
    out = []

    def run(w, state, n):
        loaders = [DistributedDataLoader(data, micro, r, w, seed=3) for r in range(w)]
        g = (micro * gas * world) // (micro * w)
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        its = [iter(ld) for ld in loaders]
        for _ in range(n):
            ids = set()
            for _ in range(g):
                for it in its:
                    ids |= set(next(it)[0].tolist())
            out.append(ids)
        return loaders[0].state_dict()

    if resume_after is None:
        run(world, None, steps)
    else:
        state = run(start_world, None, resume_after)
        run(world, state, steps - resume_after)
    return out


def test_each_step_takes_the_same_samples_at_any_size_and_across_a_resume():
    uninterrupted = step_samples(6, 1, 2, 8)  # global batch 12
    assert all(len(s) == 12 for s in uninterrupted)
    assert len(set().union(*uninterrupted)) == 96  # each sample once
    assert step_samples(4, 1, 3, 8) == uninterrupted
    assert step_samples(1, 1, 12, 8) == uninterrupted
    assert step_samples(4, 1, 3, 8, start_world=6, resume_after=3) == uninterrupted  # shrink
    assert step_samples(6, 1, 2, 8, start_world=2, resume_after=5) == uninterrupted  # grow


def test_the_loader_state_continues_the_epoch_or_starts_the_next():
    data = TensorDataset(torch.arange(10))
    ld = DistributedDataLoader(data, 2, 0, 1, shuffle=False)
    assert ld.state_dict() == {"epoch": 0, "offset": 0}
    it = iter(ld)
    next(it), next(it)
    assert ld.state_dict() == {"epoch": 1, "offset": 4}
    other = DistributedDataLoader(data, 1, 1, 2, shuffle=False)  # rank 1 of 2 resumes at 4
    other.load_state_dict(ld.state_dict())
    assert [int(b[0]) for b in other] == [5, 7, 9] and other.epoch == 1
    assert [int(b[0]) for b in other] == [1, 3, 5, 7, 9]  # the next epoch from its start
    old = DistributedDataLoader(data, 2, 0, 1, shuffle=False)
    old.load_state_dict({"epoch": 1})  # a checkpoint from before offsets: the next epoch
    assert old.epoch == 1 and len(list(old)) == 5
    list(it)
    assert ld.state_dict() == {"epoch": 1, "offset": 0}  # the epoch is done


# ------------------------------------------------------------------------ the runtime's driver, one process

class FakeAgent:
    def __init__(self):
        self.name = f"@test-agent-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.settimeout(10)
        self.worker = None

    def messages(self):
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                data, addr = self.sock.recvfrom(1 << 20)
                self.worker = addr
                out.append(json.loads(data))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(10)
        return out

    def ask(self, cmd):
        self.sock.sendto(json.dumps({"cmd": cmd}).encode(), self.worker)


def _engine(data):
    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.lin(x), y)

    return deepspeed.initialize(model=Net(), training_data=data, config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def _own_rendezvous(monkeypatch):
    """The one-process engine sets MASTER_ADDR/PORT in this process's environment: set them here
    instead, so they are gone after the test (a later child process must not inherit them)."""
    from dist_harness import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_driver_saves_keeps_two_reports_and_stops_for_a_drain_then_resumes(tmp_path, monkeypatch):
    _own_rendezvous(monkeypatch)
    agent = FakeAgent()
    monkeypatch.setenv("DSLAUNCH_SAVE_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("DSLAUNCH_SAVE_EVERY", "2")
    monkeypatch.setenv("DSLAUNCH_BASE_WORLD_SIZE", "2")  # the batch is configured for 2 ranks: 1 x 2 x 2
    monkeypatch.setenv("DSLAUNCH_MAX_WORLD_SIZE", "4")
    monkeypatch.setenv("DSLAUNCH_AGENT_SOCKET", agent.name)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 1, generator=g))
    engine, _, loader, _ = _engine(data)
    assert engine.gradient_accumulation_steps() == 4  # one rank: 4 micro batches of 1 per step
    hello = agent.messages()[0]
    assert hello["hello"] and hello["facts"] == {"batch": 4, "micro": 1, "model": 1}
    it = iter(loader)
    stopped, asked = None, False
    for _ in range(100):
        x, y = next(it)
        try:
            loss = engine(x, y)
        except SystemExit as exc:
            stopped = exc.code
            break
        engine.backward(loss)
        engine.step()
        if engine.global_steps == 7 and not asked:
            agent.messages()
            agent.ask("drain")
            asked = True
    assert stopped == 75
    assert engine.global_steps == 8  # the drain, asked after step 7, is agreed on at step 8
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step6", "global_step8", "latest", "zero_to_fp32.py"]
    reports = agent.messages()
    assert {"rank": 0, "step": 8, "saved": 8} in reports
    state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert loader.offset() == 8 * 4 + 1  # the loop took one more batch before the forward stopped it

    from dist_harness import teardown

    teardown()
    engine2, _, loader2, _ = _engine(data)  # a new attempt: initialize() resumes
    assert engine2.global_steps == 8 and loader2.offset() == 0
    assert all(torch.equal(p, state[n]) for n, p in engine2.module.named_parameters())
    first = next(iter(loader2))
    assert torch.equal(first[0], data[loader2.sampler._permutation()[32]][0].unsqueeze(0))


def test_without_an_agent_only_saving_happens(tmp_path, monkeypatch):
    _own_rendezvous(monkeypatch)
    monkeypatch.setenv("DSLAUNCH_SAVE_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("DSLAUNCH_SAVE_EVERY", "1")
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    engine, _, loader, _ = _engine(data)
    assert engine.gradient_accumulation_steps() == 4 and engine._resize.link is None
    for x, y in loader:
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 2 and os.path.exists(tmp_path / "ck" / "global_step2")


# ------------------------------------------------------------------------ the node agent's socket

WORKER = r"""
import os, sys, time
from dslaunch.runtime.train.resize.link import AgentLink
link = AgentLink(os.environ["DSLAUNCH_AGENT_SOCKET"], int(os.environ["RANK"]))
link.send({"hello": True, "facts": {"sizes": {"2": [1, 2]}}})
link.send({"step": 3, "saved": 2})
print("ready", flush=True)
while True:
    got = link.requests()
    if got:
        print("got", sorted(got), flush=True)
        sys.exit(75)
    time.sleep(0.02)
"""


@pytest.mark.timeout(120)
def test_agent_forwards_progress_and_drain_and_sigterm_asks_to_leave():
    from dslaunch.launcher.plan import WorkerPlan
    from dslaunch.launcher.protocol import AgentRequest

    workers = tuple(WorkerPlan(r, r, (sys.executable, "-c", WORKER), {"RANK": str(r)}) for r in range(2))
    req = AgentRequest("h", workers, restart=0, kill_grace=2.0, heartbeat_s=0.2, heartbeat_timeout=60,
                       finished=False, elastic=True).to_line()
    agent = subprocess.Popen([sys.executable, "-u", "-m", "dslaunch.launcher.agent"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        agent.stdin.write(req)
        agent.stdin.flush()
        events = []

        def until(pred):
            """The first event, already read or still to come, that matches."""
            for ev in events:
                if pred(ev):
                    return ev
            while True:
                raw = agent.stdout.readline()
                assert raw, agent.stderr.read().decode()
                ev = json.loads(raw)
                events.append(ev)
                if pred(ev):
                    return ev

        until(lambda ev: ev["ev"] == "line" and ev["data"].startswith("ready") and ev["rank"] == 0)
        until(lambda ev: ev["ev"] == "line" and ev["data"].startswith("ready") and ev["rank"] == 1)
        assert until(lambda ev: ev["ev"] == "progress" and ev.get("facts"))["facts"] == {"sizes": {"2": [1, 2]}}
        assert until(lambda ev: ev["ev"] == "progress" and ev.get("saved") == 2)["step"] == 3
        agent.send_signal(15)
        until(lambda ev: ev["ev"] == "leaving")  # the workers keep running: the head decides
        agent.stdin.write(b'{"cmd": "drain"}\n')
        agent.stdin.flush()
        # (a worker whose hello the agent has not read yet gets the request when it does)
        assert until(lambda ev: ev["ev"] == "asked")["cmd"] == "drain"
        done = until(lambda ev: ev["ev"] == "done")
        got = [ev["data"] for ev in events if ev["ev"] == "line" and ev["data"].startswith("got")]
        assert got and all(g == "got ['drain']\n" for g in got)
        assert done["failure"]["exit_code"] == 75
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait()


# ------------------------------------------------------------------------ the head's decisions, scripted

class _Said:
    def __init__(self):
        self.lines = []

    def say(self, text):
        self.lines.append(text)

    def summary(self, s):
        self.lines.append(f"summary: {s.failure.describe()}")

    def start_attempt(self, *a):
        pass


def _scripted_head(tmp_path, results, min_nodes=1, probe=lambda t: False):
    from dslaunch.launcher.elastic_head import ElasticHead
    from dslaunch.launcher.machine import MachineFacts
    from dslaunch.launcher.options import LaunchOptions
    from dslaunch.launcher.plan import build_plan

    (tmp_path / "hosts").write_text("h1 slots=2\nh2 slots=2\nh3 slots=2\n")
    facts = MachineFacts(0, None, 2, ("box",), python="/usr/bin/python3", cwd=str(tmp_path), home=str(tmp_path))
    opts = LaunchOptions("t.py", hostfile=str(tmp_path / "hosts"), min_nodes=min_nodes, max_restarts=1,
                         checkpoint_dir="ck", checkpoint_every=4, master_port=0)
    plan = build_plan(opts, facts, {}, run_id="r")

    def rebuild(targets):
        return build_plan(opts, facts, {}, run_id="r", only_hosts=list(targets), base_world=6)

    class Head(ElasticHead):
        def _attempt(self, restart):
            self.ran.append(tuple(n.target for n in self.plan.nodes))
            step = results.pop(0)
            return step(self) if callable(step) else step

    head = Head(plan, lambda nodes: [], _Said(), None, rebuild=rebuild,
                pool=lambda: [("h1", 2), ("h2", 2), ("h3", 2)], probe=probe)
    head.ran = []
    head.facts = Facts.from_report({"batch": 12, "micro": 1, "model": 1})
    return head


class _NoSignal:
    first = None


def test_the_head_shrinks_on_a_loss_restarts_on_a_failure_and_gives_up_below_min(tmp_path):
    from dslaunch.launcher.attempts import AttemptResult
    from dslaunch.launcher.failure import Failure, host_failure

    def lost(host, why, step, saved):
        def result(head):
            head.step, head.saved = step, saved
            f = host_failure(host, why)
            return AttemptResult(255, f, None, {}, 6, lost={host: why})
        return result

    crash = Failure(0, "h1:0", 3)
    head = _scripted_head(tmp_path, [
        lost("h3", "lost: nothing from its agent for 10s (--heartbeat_timeout 10; ...)", 1240, 1200),
        AttemptResult(3, crash, None, {}, 4),  # a worker failed on a host that is still there: same hosts
        lost("h2", "lost its node agent (the connection dropped or the agent died)", 1300, 1296),
        lost("h1", "lost its node agent (the connection dropped or the agent died)", 1310, 1300),
    ])
    assert head._run(_NoSignal()) == 255
    assert head.ran == [("h1", "h2", "h3"), ("h1", "h2"), ("h1", "h2"), ("h1",)]
    said = head.output.lines
    assert "host h3 lost at step 1,240 (no heartbeat for 10 s); resuming on 2 of 3 hosts from step 1,200, " \
           "accumulation 2 -> 3" in said
    assert "summary: h1:0 failed first: exited with code 3" in said and "restarting every worker (restart 1 of 1)" in said
    assert "host h2 lost at step 1,300 (its agent's connection dropped); resuming on 1 of 3 hosts from step " \
           "1,296, accumulation 3 -> 6" in said
    assert said[-1] == "host h1 lost at step 1,310 (its agent's connection dropped); 0 host(s) left, below " \
                       "--min_nodes 1: giving up"


def test_the_head_drops_a_drained_host_and_takes_back_one_that_answers(tmp_path):
    from dslaunch.launcher.attempts import AttemptResult
    from dslaunch.launcher.control import Request

    def drained(head):
        ok, text = head._control(Request("drain", "h2"))
        assert ok and text == "draining h2: the job saves at the next step boundary and goes on on 2 host(s)"
        assert head._control(Request("drain", "h9"))[1] == "h9: not a host of job r (its hosts: h1, h2, h3)"
        assert head._control(Request("undrain", "h3"))[1] == "h3 is not drained"
        head.step = head.saved = 77
        return AttemptResult(0, None, None, {}, 6, resized=True)

    def grown(head):
        assert head._control(Request("drain", "h1"))[1] == "draining h1 would leave 1 host(s), below --min_nodes 2"
        assert head._control(Request("undrain", "h2"))[0]
        head._back.add("h2")
        head.step = head.saved = 80
        return AttemptResult(0, None, None, {}, 4, resized=True)

    head = _scripted_head(tmp_path, [drained, grown, AttemptResult(0, None, None, {}, 6)], min_nodes=2)
    assert head._run(_NoSignal()) == 0
    assert head.ran == [("h1", "h2", "h3"), ("h1", "h3"), ("h1", "h2", "h3")]
    said = head.output.lines
    assert "host h2 drained at step 77; resuming on 2 of 3 hosts from step 77, accumulation 2 -> 3" in said
    assert "h2 is back; growing to 3 hosts at step 80; resuming on 3 of 3 hosts from step 80, accumulation 3 -> 2" \
        in said


def test_the_head_plans_only_sizes_the_batch_allows(tmp_path):
    from dslaunch.launcher.attempts import AttemptResult
    from dslaunch.launcher.failure import host_failure

    def lost_h3(head):
        head.facts = Facts.from_report({"sizes": {"6": [1, 2], "2": [1, 6]}})  # an elasticity section's list
        head.step, head.saved = 9, 8
        return AttemptResult(255, host_failure("h3", "x"), None, {}, 6, lost={"h3": "x"})

    head = _scripted_head(tmp_path, [lost_h3, AttemptResult(0, None, None, {}, 2)])
    assert head._run(_NoSignal()) == 0
    assert head.ran[-1] == ("h1",)  # 4 ranks are not allowed; 2 are
    assert "host h3 lost at step 9 (x); resuming on 1 of 3 hosts from step 8, accumulation 2 -> 6" in head.output.lines


# ------------------------------------------------------------------------ --checkpoint_dir on one machine

@pytest.mark.timeout(600)
def test_a_restarted_job_resumes_from_its_last_checkpoint(tmp_path):
    """Not elastic: `--checkpoint_dir --checkpoint_every 2 --max_restarts 1` on 2 local workers;
    a rank dies as step 5 begins; the restart resumes from step 4 (initialize() loads it, the
    loader goes on from its offset) and every step's loss is the one-process run's."""
    worker = str(repo_paths.WORKERS / "elastic_job.py")
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run([sys.executable, worker, "zero2", "6"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=300)
    assert ref.returncode == 0, ref.stderr
    want = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+) world 1$", ref.stdout, re.M)}
    res = subprocess.run([sys.executable, "-m", "dslaunch.launcher", "--num_gpus", "2", "--checkpoint_dir", "ck",
                          "--checkpoint_every", "2", "--max_restarts", "1", worker, "zero2", "6"],
                         capture_output=True, text=True, cwd=tmp_path, env={**env, "CRASH_AT": "5"}, timeout=500)
    assert res.returncode == 0, res.stderr
    got = [(int(s), float(v)) for s, v in re.findall(r"^\[rank 0\] step (\d+) loss (\S+) world 2$", res.stdout,
                                                        re.M)]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6]  # step 5 never finished the first time
    assert all(abs(v - want[s]) < 1e-5 for s, v in got)
    assert "restarting every worker (restart 1 of 1)" in res.stderr
    assert f"dslaunch: resumed from {tmp_path / 'ck' / 'global_step4'} at step 4 on 2 rank(s)" in res.stderr
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step4", "global_step6", "latest", "zero_to_fp32.py"]
