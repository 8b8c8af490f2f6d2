"""The node agent: `python -m dslaunch.launcher.agent`, one per host of a multi-node job.

The head starts it (over SSH, through pdsh, or as a local subprocess for its own machine)
and sends it an AgentRequest (protocol.py): this node's workers for one attempt, argv and
env already planned by the head. The agent applies what only this host knows (accelerator,
OMP_NUM_THREADS, --bind_cores_to_rank cores; plan.finish_workers), runs the workers with
the single-node Supervisor and reports lines, the first failure and the end as JSON events
on stdout, through a bounded buffer, so a stalled channel never stalls supervision.

The head and the agent watch each other: the head pings every heartbeat_s, the agent
sends `hb` as often. When no ping (or other line) has come from the head for
heartbeat_timeout seconds, or its channel ends (EOF: the head died, the connection was
closed), or a `stop` arrives, the agent stops its workers (SIGTERM, SIGKILL after the
grace period) and exits. Signal requests over SSH are not relied on (OpenSSH refuses them
for root) and a session without a pty gets no SIGHUP, so without this watch a lost head
would leave the workers running as orphans until the network came back.

Control channel: stdin under ssh. pdsh gives remote commands no stdin, so there the head
writes each node's request into a file readable only by the user (`--request_file`,
removed as soon as it is read; the working directory must be the same on every host),
which also names a TCP port and a one-time token: the agent connects back to the head
(at the address in $SSH_CONNECTION) and the pings and stop travel over that socket.
The file sits in a folder other users may be able to reach, so the agent trusts it only
after checking, on the descriptors it reads, that the folder is a real 0700 directory of
ours and the file a 0600 file of ours with one link (private_files.read_private); and it
runs nothing until the head has proved, over the socket, that it knows the file's token
(protocol.control_proof): a request that the head did not write for this run is refused.
"""
from __future__ import annotations

import argparse
import hmac
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import BinaryIO, Callable, Optional

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.failure import Failure
from dslaunch.launcher.output import OutputLine
from dslaunch.launcher.private_files import read_private
from dslaunch.launcher.protocol import AgentRequest, ProtocolError, control_proof, decode, encode
from dslaunch.launcher.writer import BoundedWriter

FIRST_LINE_TIMEOUT = 120.0  # a head that connected but never sent a request is gone
HANDSHAKE_TIMEOUT = 30.0  # pdsh: a head that does not answer the token handshake by then is not ours
REQUEST_FILE_LIMIT = 64 << 20  # one node's workers' argv and env


class _Events:
    """The agent's event stream to the head; implements supervisor.GroupObserver."""

    def __init__(self, stream: BinaryIO, on_broken: Callable[[], None]):
        self.writer = BoundedWriter(stream, name="dslaunch-agent-out", on_broken=on_broken)

    def emit(self, obj: dict, force: bool = True) -> None:
        self.writer.write(encode(obj), force=force)

    def line(self, line: OutputLine) -> None:
        self.emit({"ev": "line", "rank": line.rank, "stream": line.stream,
                   "data": line.data.decode("utf-8", "replace")}, force=False)

    def failed(self, failure: Failure) -> None:
        self.emit({"ev": "failed", "failure": failure.to_dict()})

    def exited(self, label: str) -> None:
        self.emit({"ev": "exited", "label": label})


def _watch_head(control: BinaryIO, stop: Callable[[str], None], seen: Callable[[], None],
                pass_on: Optional[Callable[[str], None]] = None) -> None:
    """Read the head's control lines until stop or EOF. Never dies on a bad line. `pass_on`
    takes the elastic requests (drain, grow) for the workers' runtime."""
    try:
        for raw in control:
            seen()
            msg = decode(raw)
            if msg is None:
                sys.stderr.write(f"dslaunch agent: ignoring a line that is not a JSON object: {raw[:80]!r}\n")
                continue
            if msg.get("cmd") == "stop":
                stop("the head asked to stop")
                return
            if msg.get("cmd") in ("drain", "grow") and pass_on is not None:
                pass_on(msg["cmd"])
    except (OSError, ValueError):
        pass
    stop("the head's channel closed")


def run(request: AgentRequest, control: BinaryIO, out: BinaryIO) -> int:
    from dslaunch.launcher.local import worker_spec
    from dslaunch.launcher.machine import detect_gpus
    from dslaunch.launcher.plan import finish_workers
    from dslaunch.launcher.supervisor import Supervisor

    lock = threading.Lock()
    state = {"sup": None, "why": None, "last": time.monotonic()}

    def stop(why: str) -> None:
        with lock:
            if state["why"] is None:
                state["why"] = why
            sup = state["sup"]
        if sup is not None:
            sup.request_stop(signal.SIGTERM)

    def seen() -> None:
        state["last"] = time.monotonic()

    events = _Events(out, on_broken=lambda: stop("the head's channel broke"))
    inherited = dict(os.environ)
    workers = request.workers
    if not request.finished:
        accelerator = "cuda" if detect_gpus(inherited)[0] else "cpu"
        if accelerator == "cpu":  # the head's slot numbers are no devices here
            workers = [replace(w, env={k: v for k, v in w.env.items() if k != "CUDA_VISIBLE_DEVICES"})
                       for w in workers]
        try:
            workers = finish_workers(workers, accelerator=accelerator,
                                     cpu_count=os.cpu_count() or 1, inherited=inherited,
                                     bind_core_list=request.bind_core_list)
        except LaunchConfigError as e:
            events.emit({"ev": "error", "text": str(e)})
            events.writer.close(timeout=5)
            return 2
    channel = None
    if request.elastic:  # the workers' runtime reports progress and takes drain/grow here
        from dslaunch.launcher.elastic import AGENT_SOCKET_VAR
        from dslaunch.launcher.worker_channel import WorkerChannel

        channel = WorkerChannel(events.emit, every=request.heartbeat_s)
        workers = [replace(w, env={**w.env, AGENT_SOCKET_VAR: channel.name}) for w in workers]
    specs = [worker_spec(w, request.restart, inherited, label=f"{request.host}:{w.rank}", cwd=os.getcwd())
             for w in workers]
    sup = Supervisor(specs, events, kill_grace=request.kill_grace)
    with lock:
        state["sup"] = sup
        if state["why"] is not None:
            sup.request_stop(signal.SIGTERM)

    def on_signal(signum, frame) -> None:
        # elastic: the first SIGTERM (a host being shut down) asks the head to drain this host,
        # which lets the job save before the workers go; a second one stops them now
        if channel is not None and signum == signal.SIGTERM and not state.get("leaving"):
            state["leaving"] = True
            events.emit({"ev": "leaving"})
            return
        stop(f"received {signal.Signals(signum).name}")

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    threading.Thread(target=_watch_head, args=(control, stop, seen, channel.request if channel else None),
                     daemon=True, name="dslaunch-agent-in").start()

    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(request.heartbeat_s):
            events.emit({"ev": "hb"})
            if channel is not None:
                channel.flush()
            silent = time.monotonic() - state["last"]
            if silent > request.heartbeat_timeout:
                stop(f"lost the head: nothing from it for {silent:.0f}s (--heartbeat_timeout "
                     f"{request.heartbeat_timeout:g})")

    threading.Thread(target=heartbeat, daemon=True, name="dslaunch-agent-hb").start()
    result = sup.run()
    finished.set()
    if channel is not None:
        channel.flush()
        channel.close()
    failed_rank = result.failure.rank if result.failure is not None else None
    events.emit({
        "ev": "done", "exit_code": result.exit_code,
        "failure": result.failure.to_dict() if result.failure is not None else None,
        "stop_signal": result.stop_signal, "stopped_because": state["why"],
        "ended": {s.label: result.states[s.rank].value for s in specs if s.rank != failed_rank},
        "dropped": events.writer.dropped,
    })
    if state["why"] is not None and state["why"].startswith("lost the head"):
        sys.stderr.write(f"dslaunch agent on {request.host}: {state['why']}; stopped the workers\n")
    # a stalled channel (the head is gone) must not keep this process alive
    if not events.writer.close(timeout=5):
        sys.stderr.flush()
        os._exit(result.exit_code)
    return result.exit_code


def _first_line(stream: BinaryIO, timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


def _connect_back(control: dict, host: str) -> BinaryIO:
    """pdsh: open the control socket to the head; both sides prove they know the token
    (protocol.py) and nothing runs unless the head's proof is right."""
    head_ip = os.environ.get("SSH_CONNECTION", "").split()[:1]
    if not head_ip:
        raise ProtocolError("no $SSH_CONNECTION: cannot tell the head's address (pdsh must use -R ssh)")
    token = control.get("token")
    try:
        port = int(control["port"])
    except (KeyError, TypeError, ValueError):
        port = None
    if not isinstance(token, str) or len(token) < 32 or port is None:
        raise ProtocolError("the request file holds no control port and token; running nothing")
    try:
        sock = socket.create_connection((head_ip[0], port), timeout=HANDSHAKE_TIMEOUT)
    except OSError as e:
        raise ProtocolError(f"cannot reach the head at {head_ip[0]}:{port} for control: "
                            f"{e.strerror or e}") from None
    nonce = secrets.token_hex(16)
    stream = sock.makefile("rb")
    try:
        sock.sendall(encode({"host": host, "nonce": nonce, "proof": control_proof(token, "agent", nonce)}))
        answer = decode(stream.readline()) or {}
    except OSError:
        answer = {}
    if not hmac.compare_digest(str(answer.get("proof", "")), control_proof(token, "head", nonce)):
        sock.close()
        raise ProtocolError(f"the head at {head_ip[0]}:{port} did not prove it knows this request's token; "
                            "running nothing")
    sock.settimeout(None)
    return stream


def _read_request_file(path: str) -> dict:
    raw = read_private(path, REQUEST_FILE_LIMIT, "--request_file")
    msg = decode(raw)
    if msg is None:
        raise ProtocolError(f"{path}: not a JSON object")
    return msg


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dslaunch.launcher.agent")
    ap.add_argument("--request_file", help="pdsh: this node's request, in a 0600 file removed once read")
    args = ap.parse_args(argv)
    out = sys.stdout.buffer
    try:
        if args.request_file:
            msg = _read_request_file(args.request_file)
            request = AgentRequest.from_message(msg)
            control = _connect_back(msg.get("control") or {}, request.host)
        else:
            raw = _first_line(sys.stdin.buffer, FIRST_LINE_TIMEOUT)
            if not raw:
                raise ProtocolError("no request on stdin (the head went away before sending it)")
            msg = decode(raw)
            if msg is None:
                raise ProtocolError(f"the first line on stdin is not a JSON object: {raw[:80]!r}")
            request = AgentRequest.from_message(msg)
            control = sys.stdin.buffer
    except (ProtocolError, LaunchConfigError, OSError) as e:
        text = f"cannot read the request: {e}" if isinstance(e, OSError) else str(e)
        out.write(encode({"ev": "error", "text": text}))
        out.flush()
        sys.exit(2)
    sys.exit(run(request, control, out))


if __name__ == "__main__":
    main()
