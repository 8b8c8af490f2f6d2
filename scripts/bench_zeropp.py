#!/usr/bin/env python3
"""ZeRO++ across hosts: bytes between hosts and step time against plain ZeRO-3, and its loss.

    .venv/bin/python scripts/bench_zeropp.py traffic [--rate 20mbit] [--rounds 1] [--deepspeed-python /work/ds-venv/bin/python]
    .venv/bin/python scripts/bench_zeropp.py converge [--steps 200]

traffic   A network-namespace SSH cluster is built for the run (tests/testbed.py: 2 hosts,
          real TCP between them over a bridge; needs root, sshd, iproute2) and GPT-lite
          (scripts/bench_gptlite.py's model, 4 layers, 128 wide, fp32) trains on 2 ranks per
          host through `dslaunch --hostfile` under each variant: plain ZeRO-3, qwZ, qgZ, hpZ,
          all three. Per variant, two phases in one job:
          1. counted: the comms logger (comm/traffic.py) counts each rank's bytes by process
             group and peer over --count-steps steps (after one warm-up step); the report
             adds them up per host pair and splits them into forward all-gathers, backward
             all-gathers and the gradient reduction (reduce-scatter or qgZ's all-to-alls);
          2. timed: the logger off (it makes every op blocking), each host's uplink (eth0 in
             its namespace) limited to --rate, --timed-steps steps timed on rank 0 after a
             barrier; the bytes each host's eth0 sent meanwhile (/proc/net/dev) are the real
             TCP bytes between the hosts.
          With --deepspeed-python, DeepSpeed 0.19.8 runs the same script and variants on
          the same cluster (its CUDA quantizer replaced by scripts/ds_cpu_quantizer.py, its
          CPU re-implementation; 2 devices per host from LOCAL_SIZE): its wire bytes and step
          times go beside ours. The link is limited with `tc ... netem rate` where the kernel
          has netem, else with `tc ... tbf` (a token bucket at the same rate); the table says which.
converge  4 local ranks, laid out as 2 hosts of 2 (NODE_RANK), train GPT-lite --steps steps
          under plain ZeRO-3 and under all three ZeRO++ features on the same data; prints
          the mean loss of the last 10 steps of each and their relative difference.

The config of every variant: stage 3, stage3_param_persistence_threshold 0 (every parameter
partitioned), stage3_max_reuse_distance 0 and stage3_prefetch_bucket_size 0 (forward releases
every gathered parameter and backward gathers it again, as for a model too large to keep
whole; DeepSpeed's prefetcher would otherwise fetch backward's parameters during forward when
the whole model fits its prefetch bucket, and keep them), AdamW (torch's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = {
    "ZeRO-3": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "hpZ": {"zero_hpz_partition_size": 2},
    "ZeRO++": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
}
MODEL = {"vocab": 256, "block": 64, "n_embd": 128, "n_head": 4, "n_layer": 4}
MICRO = 4
LR = 1e-3


def config(variant: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                  **VARIANTS[variant]}}


def _corpus(max_bytes: int = 2_000_000):
    """The Python standard library's own .py files as bytes (on every machine, no download),
    as scripts/train_gpt.py trains on."""
    import glob
    import sysconfig

    import torch

    blob = b""
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        blob += Path(path).read_bytes()
        if len(blob) >= max_bytes:
            break
    return torch.frombuffer(bytearray(blob[:max_bytes]), dtype=torch.uint8).long()


def _eth0_tx() -> int:
    """Bytes this network namespace's eth0 has sent (/proc/net/dev is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            return int(rest.split()[8])
    return 0


# -- the training worker (one rank) -------------------------------------------------------------
def worker(job: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if job.get("emulate_hosts"):
        os.environ["NODE_RANK"] = str(rank // job["emulate_hosts"])
        os.environ["LOCAL_SIZE"] = str(job["emulate_hosts"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from bench_gptlite import GPTlite, batch

    if job["impl"] == "deepspeed":
        import deepspeed
        import deepspeed.runtime.comm.coalesced_collectives as coalesced
        import deepspeed.runtime.zero.partition_parameters as partition

        import ds_cpu_quantizer

        partition.CUDAQuantizer.quantizer_cuda_module = ds_cpu_quantizer
        coalesced.quantizer_module = ds_cpu_quantizer
        deepspeed.init_distributed("gloo")
        ds = deepspeed
    else:
        import dslaunch.runtime as ds
        from dslaunch.runtime import comm

        ds.init_distributed("gloo")
    corpus = _corpus()
    torch.manual_seed(0)
    model = GPTlite(**MODEL)
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config(job["variant"]))
    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0

    def train_step():
        nonlocal step
        x, y = batch(corpus, step, rank, MICRO, MODEL["block"], torch.device("cpu"))
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        step += 1
        return loss.item()

    out = {"variant": job["variant"], "impl": job["impl"]}
    if job.get("count_steps") and job["impl"] == "dslaunch":
        train_step()  # warm-up: the first forward records the module order
        comm.configure(enabled=True, prof_all=True)
        comm.reset_log()
        for _ in range(job["count_steps"]):
            train_step()
        report = comm.traffic_report()
        comm.configure(enabled=False)
        n = job["count_steps"]
        out["counted"] = {
            "inter": report.inter_host_bytes() / n,
            "forward_gather": report.inter_host_bytes("forward", "all_gather") / n,
            "backward_gather": report.inter_host_bytes("backward", "all_gather") / n,
            "grads": (report.inter_host_bytes("backward", "reduce_scatter")
                      + report.inter_host_bytes("backward", "all_to_all")) / n,
            "all_gather_total": report.inter_host_bytes(None, "all_gather") / n,
            "table": report.table() if rank == 0 else ""}
    losses = []
    if job.get("timed_steps"):
        train_step()
        dist.barrier()
        if job.get("shape_file"):  # the driver limits the link now (it polls for this file)
            if rank == 0:
                Path(job["shape_file"]).write_text("go")
            while not Path(job["shape_file"] + ".done").exists():
                time.sleep(0.05)
            dist.barrier()
        tx0 = _eth0_tx()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(job["timed_steps"]):
            losses.append(train_step())
        dist.barrier()
        seconds = time.perf_counter() - t0
        tx = _eth0_tx() - tx0
        if local_rank == 0 and job.get("host_file"):
            Path(f"{job['host_file']}.{os.environ.get('NODE_RANK', '0')}").write_text(str(tx))
        out["step_s"] = seconds / job["timed_steps"]
    for _ in range(job.get("train_steps", 0)):
        losses.append(train_step())
    if losses:
        t = torch.tensor(losses)
        dist.all_reduce(t)
        out["losses"] = (t / world).tolist()
    if rank == 0:
        Path(job["out"]).write_text(json.dumps(out))


# -- traffic on the namespace cluster ---------------------------------------------------------------
def _shape(tb, rate: str, on: bool) -> str:
    """Limit (or free) each host's eth0; returns the qdisc used."""
    used = ""
    for h in tb.hosts:
        base = ["ip", "netns", "exec", h.netns, "tc", "qdisc"]
        if not on:
            subprocess.run(base + ["del", "dev", "eth0", "root"], capture_output=True)
            continue
        r = subprocess.run(base + ["replace", "dev", "eth0", "root", "netem", "rate", rate], capture_output=True,
                           text=True)
        used = "netem"
        if r.returncode != 0:
            subprocess.run(base + ["replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "64kb",
                                   "latency", "200ms"], check=True, capture_output=True, text=True)
            used = "tbf (this kernel has no netem)"
    return used


def _run_job(tb, env, work: Path, impl: str, variant: str, args, ds_python: str):
    hostfile = work / "hosts"
    hostfile.write_text("".join(f"{h.name} slots=2\n" for h in tb.hosts))
    out = work / f"{impl}-{variant}.json"
    shape_file = work / f"{impl}-{variant}.shape"
    host_file = work / f"{impl}-{variant}.tx"
    # a previous round's files would let the workers skip the limit (and pass off its results)
    for stale in [out, shape_file, Path(f"{shape_file}.done")] + [Path(f"{host_file}.{n}") for n in range(len(tb.hosts))]:
        stale.unlink(missing_ok=True)
    job = {"impl": impl, "variant": variant, "out": str(out), "count_steps": args.count_steps,
           "timed_steps": args.timed_steps, "shape_file": str(shape_file), "host_file": str(host_file)}
    cmd = [sys.executable, "-m", "dslaunch.launcher", "--hostfile", str(hostfile), "--no_local_rank",
           "--master_port", "0", "--export", "DS_ACCELERATOR"]
    if impl == "deepspeed":
        cmd += ["--no_python", ds_python, str(Path(__file__)), "--worker", json.dumps(job)]
    else:
        cmd += [str(Path(__file__)), "--worker", json.dumps(job)]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    qdisc = ""
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None:  # limit the link once the workers reach the timed phase
        if shape_file.exists() and not Path(f"{shape_file}.done").exists():
            qdisc = _shape(tb, args.rate, True)
            Path(f"{shape_file}.done").write_text("")
        if time.monotonic() > deadline:
            proc.kill()
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    _shape(tb, args.rate, False)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{impl} {variant}: the job failed ({proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wire"] = sum(int(Path(f"{host_file}.{n}").read_text()) for n in range(len(tb.hosts))) / args.timed_steps
    if not qdisc:
        raise SystemExit(f"{impl} {variant}: the workers never asked for the link limit")
    result["qdisc"] = qdisc
    return result


def traffic(args) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import testbed

    work = Path(tempfile.mkdtemp(prefix="dslaunch-zeropp-"))
    tb = testbed.build_free("zp", 140, 10, 2, work / "testbed")
    try:
        env = tb.ssh_env(work / "home")
        env.update(GLOO_SOCKET_IFNAME="eth0", DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
            [str(HERE), env.get("PYTHONPATH", "")]))
        impls = ["dslaunch"] + (["deepspeed"] if args.deepspeed_python else [])
        results = {}
        for rnd in range(args.rounds):  # the step time kept is each job's fastest round (load from others)
            for variant in args.variants.split(","):
                for impl in impls:
                    r = _run_job(tb, env, work, impl, variant, args, args.deepspeed_python)
                    print(f"round {rnd + 1}: {impl} {variant}: step {r['step_s']:.3f} s, wire {r['wire'] / 1e6:.2f} "
                          f"MB/step", flush=True)
                    old = results.get((impl, variant))
                    if old is not None:
                        r["step_s"] = min(r["step_s"], old["step_s"])
                    results[(impl, variant)] = r
        _print_table(results, impls, args)
        if args.json:
            Path(args.json).write_text(json.dumps({f"{i}/{v}": r for (i, v), r in results.items()}, indent=1))
    finally:
        tb.teardown()


def _print_table(results, impls, args) -> None:
    base = results[("dslaunch", "ZeRO-3")]["counted"]
    qdisc = results[("dslaunch", "ZeRO-3")]["qdisc"]
    print(f"\nGPT-lite (n_layer {MODEL['n_layer']}, n_embd {MODEL['n_embd']}, fp32), 2 hosts x 2 ranks, "
          f"micro-batch {MICRO}; bytes between the hosts per step (comms logger, summed over ranks) and x plain ZeRO-3:")
    print(f"{'variant':<8} {'fwd all-gather':>20} {'bwd all-gather':>20} {'gradients':>20} {'all':>20}")
    variants = [v for v in VARIANTS if ("dslaunch", v) in results]
    for v in variants:
        c = results[("dslaunch", v)]["counted"]
        cells = [f"{c[k] / 1e6:7.2f} MB {c[k] / base[k] if base[k] else 0:5.2f}x"
                 for k in ("forward_gather", "backward_gather", "grads", "inter")]
        print(f"{v:<8} " + " ".join(f"{x:>20}" for x in cells))
    rounds = f", the fastest of {args.rounds} runs" if args.rounds > 1 else ""
    print(f"\nstep time with each host's uplink limited to {args.rate} ({qdisc}), mean of {args.timed_steps} steps"
          f"{rounds}; TCP bytes the hosts' eth0 sent per step:")
    head = f"{'variant':<8} {'dslaunch s/step':>16} {'x ZeRO-3':>9} {'wire MB/step':>13}"
    if "deepspeed" in impls:
        head += f" {'DeepSpeed s/step':>17} {'x ZeRO-3':>9} {'wire MB/step':>13} {'ours / DS time':>15}"
    print(head)
    t0 = {i: results[(i, "ZeRO-3")]["step_s"] for i in impls}
    for v in variants:
        r = results[("dslaunch", v)]
        line = f"{v:<8} {r['step_s']:>16.3f} {r['step_s'] / t0['dslaunch']:>9.2f} {r['wire'] / 1e6:>13.2f}"
        if "deepspeed" in impls:
            d = results[("deepspeed", v)]
            line += (f" {d['step_s']:>17.3f} {d['step_s'] / t0['deepspeed']:>9.2f} {d['wire'] / 1e6:>13.2f}"
                     f" {r['step_s'] / d['step_s']:>15.2f}")
        print(line)


# -- convergence -------------------------------------------------------------------------------------
def _spawned(rank: int, world: int, port: int, job: dict, path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    worker(dict(job, out=f"{path}.{rank}"))


def converge(args) -> None:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(HERE))
    from bench_ranks import free_port

    finals = {}
    for variant in ("ZeRO-3", "ZeRO++"):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result")
            t0 = time.perf_counter()
            mp.spawn(_spawned, args=(4, free_port(), {"impl": "dslaunch", "variant": variant,
                                                      "train_steps": args.steps, "emulate_hosts": 2}, path),
                     nprocs=4, join=True)
            losses = json.loads(Path(f"{path}.0").read_text())["losses"]
        finals[variant] = statistics.mean(losses[-10:])
        print(f"{variant}: {args.steps} steps in {time.perf_counter() - t0:.0f} s; loss first {losses[0]:.4f}, "
              f"mean of the last 10 {finals[variant]:.4f}", flush=True)
    rel = (finals["ZeRO++"] - finals["ZeRO-3"]) / finals["ZeRO-3"]
    print(f"ZeRO++ (qwZ + qgZ + hpZ) ends {rel * 100:+.2f}% from plain ZeRO-3 (target: within 2%)")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("traffic", help="bytes and step time on the namespace cluster")
    t.add_argument("--rate", default="20mbit", help="each host's uplink during the timed steps (tc rate)")
    t.add_argument("--count-steps", type=int, default=2)
    t.add_argument("--timed-steps", type=int, default=5)
    t.add_argument("--rounds", type=int, default=1, help="run every job this many times; the fastest step time counts")
    t.add_argument("--timeout", type=float, default=900, help="seconds per job")
    t.add_argument("--deepspeed-python", default="", help="also run DeepSpeed 0.19.8 with this Python")
    t.add_argument("--json", default="", help="write every result here too")
    t.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (ZeRO-3 first: the base)")
    c = sub.add_parser("converge", help="GPT-lite loss after --steps steps, ZeRO++ against ZeRO-3")
    c.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    traffic(args) if args.what == "traffic" else converge(args)


if __name__ == "__main__":
    main()
