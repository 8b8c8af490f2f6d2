"""The head of a multi-node job: one node agent per host, one job made of them.

    head ──link──> agent (host A) ──> workers rank 0..k
         ──link──> agent (host B) ──> workers rank k+1..

The plan (plan.py) already holds every worker's argv and env; the head only hands each
node's part to that node's agent over a link (ssh channel, pdsh, local subprocess: the
backend's business, see backends/) and supervises the agents. Transport-independent.

Keeping the job whole:
- an agent reports its node's first failure at once; the head then tells every other
  agent to stop (they SIGTERM their workers, SIGKILL after --kill_grace) and ends the
  attempt with that failure;
- heartbeats: the head pings every agent every heartbeat_s and counts any event from
  an agent as a sign of life. A host silent for --heartbeat_timeout (a partition, a
  dead machine, a hung sshd) is lost: the head stops every other host and exits 255
  naming it. The agent, missing the head's pings as long, kills its own workers;
- SIGINT/SIGTERM/SIGHUP to the head: the same stop everywhere, exit 128+N;
- --max_restarts restarts the whole job on every node (attempts.run_attempts).
Sending never blocks the loop: what a link cannot take at once, its sender thread writes.
"""
from __future__ import annotations

import collections
import os
import queue
import select
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Deque, Dict, List, Optional, Sequence

from dslaunch.launcher.attempts import AttemptResult, StopSignals, run_attempts
from dslaunch.launcher.failure import Failure, host_failure
from dslaunch.launcher.line_reader import shared_reader
from dslaunch.launcher.output import STDERR, STDOUT, JobOutput, OutputLine
from dslaunch.launcher.plan import LaunchPlan, NodePlan
from dslaunch.launcher.protocol import PING, STOP, AgentRequest, decode


START_CONCURRENCY = 32  # links started at once (each SSH session open is a network round trip)


def heartbeat_interval(timeout: float) -> float:
    """Pings often enough that a few lost to load never look like a silent host."""
    return max(0.2, min(2.0, timeout / 5))


def silence_check_interval(interval: float) -> float:
    """How often the head looks for silent hosts: a lost host is named at most this late."""
    return min(interval, 0.25)


class AgentLink:
    """One node agent's channel. Subclasses start the agent and feed its output to post().

    send() never blocks the caller: a transport that can take the bytes at once
    (write_nowait) gets them on the caller's thread; whatever it cannot take, and every
    later send until that backlog is written, goes to the link's sender thread, started
    the first time it is needed, which does the blocking writes (a partitioned link may
    block). A thread per link that wakes for every ping was most of the head's CPU at a
    thousand hosts, so the thread is kept for links that need it.
    """

    def __init__(self, host: str):
        self.host = host
        self._send_lock = threading.Lock()
        self._send_wake = threading.Condition(self._send_lock)
        # chunks not yet written, in order; the head of the deque stays there while the
        # sender thread writes it, so a send meanwhile knows it must queue behind it
        self._outbox: Deque[bytes] = collections.deque()
        self._sender: Optional[threading.Thread] = None
        self._sending_stopped = False
        self._send_failed = False
        self._post: Optional[Callable[[dict], None]] = None

    def start(self, post: Callable[[dict], None], request: AgentRequest) -> None:
        """Start the agent, hand it the request; events (parsed or {"ev": "agent_err"}) go to post."""
        raise NotImplementedError

    def write(self, data: bytes) -> None:
        """Write all of data, blocking as long as the transport needs (the sender thread's call)."""
        raise NotImplementedError

    def write_nowait(self, data: bytes) -> Optional[int]:
        """Write what the transport takes without blocking; how many bytes that was (0: none
        now). None: this transport cannot tell, so every send goes through the sender thread."""
        return None

    def close(self) -> None:
        """End the channel: the agent sees EOF and stops its workers."""
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        with self._send_lock:
            if self._sending_stopped or self._send_failed:
                return
            if not self._outbox:
                try:
                    taken = self.write_nowait(data)
                except Exception:
                    self._send_failed = True  # a dead link ends in an eof event from its reader
                    return
                if taken is not None:
                    data = data[taken:]
                    if not data:
                        return
            self._outbox.append(data)
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, daemon=True, name=f"dslaunch-send-{self.host}")
                self._sender.start()
            self._send_wake.notify()

    def _send_loop(self) -> None:
        while True:
            with self._send_lock:
                while not self._outbox and not self._sending_stopped:
                    self._send_wake.wait()
                if not self._outbox:
                    return
                data = self._outbox[0]
            try:
                self.write(data)
            except Exception:
                with self._send_lock:
                    self._send_failed = True
                    self._outbox.clear()
                return
            with self._send_lock:
                self._outbox.popleft()

    def stop_sending(self) -> None:
        """What was sent is still written; later sends are dropped."""
        with self._send_lock:
            self._sending_stopped = True
            self._send_wake.notify()

    def read_events(self, stream, post: Callable[[dict], None]) -> None:
        """Reader-thread body for a stream of JSON event lines; ends with an eof event.
        (For a transport that is a file descriptor, watch_events shares one thread instead.)"""
        try:
            for raw in stream:
                post(_event(raw))
        except Exception:
            pass
        post({"ev": "eof"})

    @staticmethod
    def read_errors(stream, post: Callable[[dict], None]) -> None:
        try:
            for raw in stream:
                post(_agent_err(raw))
        except Exception:
            pass

    @staticmethod
    def watch_events(fd: int, post: Callable[[dict], None]) -> None:
        """read_events for a pipe or socket, on the process's one link reader thread."""
        shared_reader().add(fd, lambda raw: post(_event(raw)), lambda: post({"ev": "eof"}))

    @staticmethod
    def watch_errors(fd: int, post: Callable[[dict], None]) -> None:
        shared_reader().add(fd, lambda raw: post(_agent_err(raw)), lambda: None)


def _event(raw: bytes) -> dict:
    return decode(raw) or _agent_err(raw)


def _agent_err(raw: bytes) -> dict:
    return {"ev": "agent_err", "text": raw.decode("utf-8", "replace").rstrip("\n")}


class LocalLink(AgentLink):
    """An agent for a node of the head's own machine: a subprocess speaking the same protocol."""

    def __init__(self, host: str, python: str, workdir: str):
        super().__init__(host)
        self._argv = [python, "-u", "-m", "dslaunch.launcher.agent"]
        self._workdir = workdir
        self.proc: Optional[subprocess.Popen] = None

    def start(self, post: Callable[[dict], None], request: AgentRequest) -> None:
        self.proc = subprocess.Popen(self._argv, cwd=self._workdir, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.set_blocking(self.proc.stdin.fileno(), False)  # written raw: write_nowait, or write() below
        self.watch_events(self.proc.stdout.fileno(), post)
        self.watch_errors(self.proc.stderr.fileno(), post)
        self.send(request.to_line())

    def write_nowait(self, data: bytes) -> int:
        try:
            return os.write(self.proc.stdin.fileno(), data)
        except BlockingIOError:
            return 0

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            select.select([], [self.proc.stdin.fileno()], [])
            view = view[self.write_nowait(view):]

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


class Head:
    def __init__(self, plan: LaunchPlan, open_links: Callable[[Sequence[NodePlan]], List[AgentLink]],
                 output: JobOutput, err_fd: Optional[int]):
        self.plan = plan
        self.output = output
        self._open_links = open_links
        self._err_fd = err_fd
        # SimpleQueue: its put is reentrant, so the signal handler (which runs on the main thread,
        # possibly inside this queue's get) cannot deadlock on the queue's lock
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._signals: Optional[StopSignals] = None
        o = plan.options
        self.timeout = o.heartbeat_timeout
        self.interval = heartbeat_interval(o.heartbeat_timeout)
        # a starting agent may take the SSH connect time on top before its first word
        self.first_timeout = o.heartbeat_timeout + o.ssh_timeout
        self.check_interval = silence_check_interval(self.interval)

    elastic = False  # ElasticHead (elastic_head.py) re-plans between attempts

    def _elastic_event(self, idx, ev, links) -> None:
        """An agent's progress, `leaving` or `asked`, or a wake-up (idx None) (elastic jobs)."""

    def _elastic_tick(self, links, pending, stop_all) -> None:
        """Each turn of the loop: send what control requests asked for (elastic jobs)."""

    def _resize_exit(self, f: Failure) -> bool:
        """Whether this worker exit is the stop for a resize the head asked for."""
        return False

    _resized = False

    def run(self) -> int:
        def on_signal(signum: int, again: bool) -> None:
            self.output.stopping(signum)
            self._events.put((None, {"ev": "signal", "sig": signum, "again": again}))

        with StopSignals(on_signal, self._err_fd, self.plan.options.kill_grace) as signals:
            self._signals = signals
            return run_attempts(self._attempt, self.plan.options.max_restarts, self.output, lambda: signals.first)

    # ---------------------------------------------------------------------- one attempt
    def _attempt(self, restart: int) -> AttemptResult:
        plan, o = self.plan, self.plan.options
        self.output.start_attempt(restart, range(plan.world.world_size))
        # a fresh queue: the last attempt's readers may still post their eofs into theirs
        events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._events = events
        if self._signals.first is not None:  # a signal that came as the attempts changed over
            events.put((None, {"ev": "signal", "sig": self._signals.first, "again": False}))
        nodes = list(plan.nodes)
        total = plan.world.world_size
        failure: Optional[Failure] = None
        stop_signal: Optional[int] = None
        ended: Dict[str, str] = {}
        try:
            links = self._open_links(nodes)
        except Exception as exc:  # a backend that cannot start its transport: the host is named
            f = host_failure(getattr(exc, "host", nodes[0].target), f"cannot start the node agent: {exc}")
            self.output.failed(f)
            return AttemptResult(f.exit_code, f, None, {}, total, lost={f.label: f.reason})
        # when each link was started: its first word is due first_timeout after that, not after
        # the first link's start (starting a thousand links takes longer than the timeout)
        started = [time.monotonic()] * len(links)
        last_seen = {i: None for i in range(len(links))}
        pending = set(range(len(links)))

        def start(i: int) -> None:
            link, node = links[i], nodes[i]
            request = AgentRequest(link.host, node.workers, restart, o.kill_grace, self.interval, self.timeout,
                                   node.finished, node.bind_core_list, elastic=self.elastic)
            started[i] = time.monotonic()
            link.start(lambda ev: events.put((i, ev)), request)

        # A few at a time: opening an SSH session is a round trip each, a thousand in a row add
        # up. Meanwhile the started agents get their pings: starting a thousand takes longer
        # than the heartbeat timeout, after which the first ones would give up on the head.
        # The pool's threads live until the attempt ends: a process a link starts with a
        # parent-death signal (pdsh) gets it when the thread that started it exits.
        next_ping = time.monotonic() + self.interval
        pool = ThreadPoolExecutor(max_workers=min(START_CONCURRENCY, len(links)) or 1,
                                  thread_name_prefix="dslaunch-start")
        # each start reports on this queue as it ends: waiting on all the pending futures at
        # once (concurrent.futures.wait) costs O(pending) per completion, O(N^2) for N links
        started_q: "queue.SimpleQueue" = queue.SimpleQueue()
        for i in range(len(links)):
            pool.submit(start, i).add_done_callback(lambda fut, i=i: started_q.put((i, fut)))
        running: List[int] = []
        try:
            while len(running) < len(links):
                try:
                    i, fut = started_q.get(timeout=max(0.0, next_ping - time.monotonic()))
                except queue.Empty:
                    pass
                else:
                    fut.result()  # a link that cannot start fails the launch as before
                    running.append(i)
                if time.monotonic() >= next_ping:
                    for j in running:
                        links[j].send(PING)
                    next_ping = time.monotonic() + self.interval
        except BaseException:
            pool.shutdown(wait=False)
            raise
        stop_deadline: Optional[float] = None
        lost: Dict[str, str] = {}  # hosts whose agent went away without reporting its end
        # silence is checked on this tick, not after every event: one scan of all hosts per
        # event made each heartbeat round cost N^2 at N hosts
        next_check = time.monotonic() + self.check_interval

        def stop_all(exclude: Sequence[int] = ()) -> None:
            nonlocal stop_deadline
            for i in pending - set(exclude):
                links[i].send(STOP)
            if stop_deadline is None:
                stop_deadline = time.monotonic() + o.kill_grace + 5

        while pending:
            now = time.monotonic()
            if now >= next_ping:
                for i in pending:
                    links[i].send(PING)
                next_ping = now + self.interval
            due = min(next_ping, next_check) if stop_deadline is None else min(next_ping, next_check, stop_deadline)
            wait = due - now
            try:
                idx, ev = events.get(timeout=max(0.0, wait))
            except queue.Empty:
                idx, ev = None, None
            now = time.monotonic()
            if ev is not None:
                kind = ev.get("ev")
                if idx is not None:
                    last_seen[idx] = now
                if kind == "signal":
                    if stop_signal is None and failure is None:
                        stop_signal = ev["sig"]
                    if ev.get("again"):
                        for i in pending:
                            links[i].close()  # agents kill at once on EOF
                    stop_all()
                    continue
                if idx is None or kind in ("progress", "leaving", "asked"):  # elastic: wake-ups, progress, ...
                    self._elastic_event(idx, ev, links)
                    continue
                host = links[idx].host
                if kind == "line":
                    data = str(ev.get("data", "")).encode("utf-8", "replace")
                    stream = STDERR if ev.get("stream") == STDERR else STDOUT
                    rank = int(ev.get("rank", -1))
                    self.output.line(OutputLine(rank, f"{host}:{rank}", stream, data))
                elif kind == "exited":
                    self.output.exited(str(ev.get("label", "")))
                elif kind in ("agent_err", "error"):
                    self.output.say(f"[{host} agent] {ev.get('text', '')}")
                    if kind == "error" and failure is None and idx in pending:
                        failure = host_failure(host, f"the node agent refused the request: {ev.get('text', '')}")
                        self.output.failed(failure)
                        stop_all(exclude=[idx])
                elif kind == "failed" and idx in pending:
                    f = Failure.from_dict(ev.get("failure") or {}).on_host(host)
                    if self._resize_exit(f):
                        stop_all(exclude=[idx])  # the others stop after the same checkpoint
                    elif failure is None and stop_signal is None:
                        failure = f
                        self.output.failed(f)
                        stop_all(exclude=[idx])
                elif kind == "done" and idx in pending:
                    pending.discard(idx)
                    ended.update({str(k): str(v) for k, v in (ev.get("ended") or {}).items()})
                    f = Failure.from_dict(ev["failure"]).on_host(host) if ev.get("failure") else None
                    if f is not None and self._resize_exit(f):
                        stop_all(exclude=[idx])
                    elif f is not None and failure is None and stop_signal is None:
                        failure = f
                        self.output.failed(f)
                        stop_all(exclude=[idx])
                    elif f is not None and failure is not None and f.label == failure.label:
                        failure = f  # an origin told as it raised; now with its exit code and stderr
                    elif f is not None and f.label != (failure.label if failure else None):
                        ended[f.label] = "failed"
                    if ev.get("dropped"):
                        self.output.say(f"{host}: {ev['dropped']} worker line(s) were dropped on the host: "
                                        "the head did not read fast enough")
                elif kind == "eof" and idx in pending:
                    pending.discard(idx)
                    lost[host] = "lost its node agent (the connection dropped or the agent died)"
                    if failure is None and stop_signal is None:
                        failure = host_failure(host, lost[host])
                        self.output.failed(failure)
                        stop_all()
            if self.elastic and failure is None and stop_signal is None:
                self._elastic_tick(links, pending, stop_all)
            # heartbeats: a host that has been silent too long is lost
            # only once every event that arrived is counted: a backlog (after the start, under
            # load) holds signs of life; a head that never catches up checks after a timeout anyway
            check = now >= next_check and (events.empty() or now >= next_check + self.timeout)
            for i in (list(pending) if check else ()):
                seen = last_seen[i]
                limit = self.timeout if seen is not None else self.first_timeout
                silent = now - (seen if seen is not None else started[i])
                if silent > limit:
                    pending.discard(i)
                    links[i].close()
                    lost[links[i].host] = (f"lost: nothing from its agent for {silent:.0f}s "
                                           f"(--heartbeat_timeout {self.timeout:g}; network partition or host down)")
                    if failure is None:
                        failure = host_failure(links[i].host, lost[links[i].host])
                        self.output.failed(failure)
                        stop_all()
            if check:
                next_check = now + self.check_interval
            if stop_deadline is not None and now >= stop_deadline and pending:
                for i in pending:  # agents that did not finish in time lose their channel: EOF makes them kill
                    self.output.say(f"{links[i].host}: its agent did not report the end in time; closing it")
                    links[i].close()
                    lost[links[i].host] = "its agent did not report the end in time"
                break
        for link in links:
            link.stop_sending()
            link.close()
        pool.shutdown(wait=False)
        if failure is not None:
            for node in nodes:  # workers of a lost host: their fate is unknown, never "succeeded"
                for w in node.workers:
                    ended.setdefault(f"{node.target}:{w.rank}", "stopped")
            ended.pop(failure.label, None)
            return AttemptResult(failure.exit_code, failure, None, ended, total, lost=lost)
        if stop_signal is not None:
            return AttemptResult(128 + stop_signal, None, stop_signal, ended, total, lost=lost)
        return AttemptResult(0, None, None, ended, total, lost=lost, resized=self._resized)
