"""The node agent: `python -m dslaunch.launcher.agent`, one per host of a multi-node job.

The head starts it over SSH and writes the node's plan (multinode.NodePlan) as one JSON
line on its stdin. The agent starts the node's workers with the single-node supervisor
(same env contract, same teardown rules), and reports on stdout, one JSON object a line:

    {"ev": "line", "rank": 3, "stream": "out"|"err", "text": "..."}
    {"ev": "failed", "code": 7, "rank": 3, "how": "...", "tail": [...]}   the moment a worker fails
    {"ev": "done", "code": 0, "rank": null, "how": "", "tail": [], "stopped": false}

Control: a later `{"cmd": "stop"}` line, or EOF on stdin, stops the workers (SIGTERM now,
SIGKILL after the grace period). EOF is how the agent learns that the head died or the
connection dropped: sshd closes the session's pipes then. Signal requests over SSH are
not relied on (OpenSSH refuses them for root), and a session without a pty gets no
SIGHUP, so without this watch the workers would run on as orphans.

Under pdsh (`--launcher pdsh`) there is no usable stdin: the plan arrives as
`--plan BASE64 --node_rank N`, and the agent instead notices a dead head by its stdout
breaking, which a heartbeat line every second makes prompt.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import threading
from typing import Optional

from dslaunch.launcher.supervisor import Supervisor, WorkerSpec

HEARTBEAT_S = 1.0


class _Out:
    """Serialised JSON-line writer; a broken pipe means the head is gone."""

    def __init__(self, on_broken):
        self.lock = threading.Lock()
        self.on_broken = on_broken
        self.broken = False

    def emit(self, ev: dict) -> None:
        data = (json.dumps(ev) + "\n").encode()
        with self.lock:
            if self.broken:
                return
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.broken = True
                self.on_broken()


def _read_plan(args) -> dict:
    if args.plan:
        plans = json.loads(base64.b64decode(args.plan))
        return plans[args.node_rank]
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit("dslaunch agent: no plan on stdin (the head went away before sending it)")
    return json.loads(line)


def run(plan: dict, watch_stdin: bool) -> int:
    host = plan["host"]
    sup_box: list = []
    stop_requested = threading.Event()

    def stop(signum: int = signal.SIGTERM) -> None:
        stop_requested.set()
        if sup_box:
            sup_box[0].request_stop(signum)

    out = _Out(on_broken=stop)
    base_env = dict(os.environ)
    # the head cannot see this host's devices; the contract's accelerator is decided here
    from dslaunch.launcher.machine import detect_gpus
    accelerator = "cuda" if detect_gpus(base_env)[0] else "cpu"
    for w in plan["workers"]:
        w["env"].setdefault("DSLAUNCH_ACCELERATOR", accelerator)
    specs = [
        WorkerSpec(
            rank=w["rank"], argv=list(w["argv"]), env={**base_env, **w["env"]},
            label=f"{host}:{w['rank']}", cwd=os.getcwd(),
        )
        for w in plan["workers"]
    ]

    def sink(spec: WorkerSpec, stream: str, line: bytes) -> None:
        out.emit({"ev": "line", "rank": spec.rank, "stream": "out" if stream == "stdout" else "err",
                  "text": line.decode("utf-8", "replace").rstrip("\r\n")})

    sup = Supervisor(specs, sink, kill_grace=float(plan.get("kill_grace", 5.0)),
                     on_failure=lambda f: out.emit(_failure_event("failed", f.exit_code, f)))
    sup_box.append(sup)
    if stop_requested.is_set():
        sup.request_stop(signal.SIGTERM)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: stop(signal.SIGTERM))

    if watch_stdin:
        def watch() -> None:
            for raw in sys.stdin.buffer:
                try:
                    if json.loads(raw).get("cmd") == "stop":
                        break
                except ValueError:
                    continue
            stop()  # a stop command, or EOF: the head is gone
        threading.Thread(target=watch, daemon=True, name="dslaunch-agent-stdin").start()
    else:
        def heartbeat() -> None:
            while not stop_requested.wait(HEARTBEAT_S):
                out.emit({"ev": "hb"})
        threading.Thread(target=heartbeat, daemon=True, name="dslaunch-agent-hb").start()

    result = sup.run()
    ev = _failure_event("done", result.exit_code, result.failure)
    ev["stopped"] = result.failure is None and result.stop_signal is not None
    ev["teardown_s"] = result.teardown_s
    out.emit(ev)
    return result.exit_code


def _failure_event(kind: str, code: int, f) -> dict:
    return {
        "ev": kind,
        "code": code,
        "rank": f.rank if f else None,
        "how": f.describe().split("failed first: ", 1)[-1] if f else "",
        "tail": list(f.stderr_tail) if f else [],
    }


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dslaunch.launcher.agent")
    ap.add_argument("--plan", help="base64 JSON list of node plans (pdsh mode; stdin otherwise)")
    ap.add_argument("--node_rank", type=int, default=0)
    args = ap.parse_args(argv)
    plan = _read_plan(args)
    sys.exit(run(plan, watch_stdin=not args.plan))


if __name__ == "__main__":
    main()
