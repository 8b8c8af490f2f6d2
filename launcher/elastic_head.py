"""The head of an elastic job: attempts on a changing set of hosts (see elastic.py).

Each attempt is Head._attempt on the current plan. Between attempts:
- a host was lost (its agent's connection dropped, it fell silent past --heartbeat_timeout,
  its agent could not start): the ranks are re-planned on the hosts left and the job starts
  again; the runtime resumes from the last complete checkpoint, so at most the steps since
  it are redone. Every surviving worker's own failure in that attempt is a follow-on of the
  loss (gloo's "Connection closed by peer"), not a failure of its own;
- the workers stopped for a resize the head asked for (exit RESIZE_EXIT_CODE after saving):
  a drain (`dslaunch drain HOST`, or SIGTERM to a host's agent) leaves the host out; a grow
  takes in the hosts that answered again;
- a worker failed on a host that is still there: the whole job restarts at the same size
  under --max_restarts, as in a job of fixed size.
Host changes never use up --max_restarts. Below --min_nodes hosts, or when the batch allows
no world size on the hosts left, the job ends (exit 255) saying why in one line.

While fewer than --max_nodes hosts run, a prober thread tries the others (the hostfile is
read again each round, so a host added to it counts): a lost host that answers joins, a
drained one only after `dslaunch undrain HOST`, one that left on SIGTERM only once it was
seen gone and then back (a host shutting down still answers for a while). With
--checkpoint_dir the head asks the runtime to stop after its next periodic checkpoint; the
job then restarts with the new hosts. A host that fails to join waits longer each time.

Everything the head says about it is one line: `host h3 lost at step 1,240 (no heartbeat for
10 s); resuming on 2 of 3 hosts from step 1,200, accumulation 4 -> 6`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from dslaunch.launcher import elastic
from dslaunch.launcher.attempts import StopSignals
from dslaunch.launcher.control import ControlServer, Request
from dslaunch.launcher.elastic import Facts, choose_hosts, in_order, resume_clause, steps
from dslaunch.launcher.failure import HOST_FAILURE_CODE, Failure
from dslaunch.launcher.head import AgentLink, Head
from dslaunch.launcher.output import AttemptSummary
from dslaunch.launcher.plan import LaunchPlan, NodePlan
from dslaunch.launcher.protocol import DRAIN, GROW
from dslaunch.launcher.reaper import signal_name

# a drain the workers do not act on (a script without the dslaunch runtime) is forced after this
DRAIN_TIMEOUT_S = 120.0


def probe_interval(heartbeat_timeout: float) -> float:
    return max(1.0, min(30.0, heartbeat_timeout / 2))


@dataclass
class _Away:
    """A host of the pool that is not in the job."""

    why: str  # "lost" | "drained" | "leaving" | "new"
    seen_down: bool = False
    failures: int = 0  # joins that failed in a row
    next_try: float = 0.0


def _name(target: str) -> str:
    return target.rpartition("@")[2]


class ElasticHead(Head):
    elastic = True

    def __init__(self, plan: LaunchPlan, open_links: Callable[[Sequence[NodePlan]], List[AgentLink]], output,
                 err_fd, *, rebuild: Callable[[Sequence[str]], LaunchPlan],
                 pool: Callable[[], List[Tuple[str, int]]], probe: Callable[[str], bool],
                 away: Optional[Dict[str, str]] = None):
        super().__init__(plan, self._guarded(open_links), output, err_fd)
        self.spec = plan.elastic
        self._rebuild = rebuild
        self._pool = pool
        self._probe = probe
        self._lock = threading.Lock()
        self._last_pool: List[Tuple[str, int]] = pool()
        self._away: Dict[str, _Away] = {t: _Away(why) for t, why in (away or {}).items()}
        self._drained: Set[str] = set()  # out until undrain
        self._leaving: Set[str] = set()  # asked to leave (SIGTERM to its agent)
        self._back: Set[str] = set()  # answered again: join at the next resize
        self._asks: List[bytes] = []  # requests for every agent, sent on the loop's next turn
        self._unasked: Set[int] = set()  # links that have not yet passed the last request to their workers
        self._notes: List[str] = []  # said once they all have
        self._resize: Optional[str] = None  # "drain" | "grow": what the workers were asked to stop for
        self._asked_at: Optional[float] = None
        self._forced = False
        self.step: Optional[int] = None
        self.saved: Optional[int] = None
        self.facts = Facts({})
        self._join_failures: Dict[str, int] = {}
        self._stop_probing = threading.Event()
        o = plan.options
        self._every = o.checkpoint_every if o.checkpoint_dir else None

    # -- links -----------------------------------------------------------------------------
    @staticmethod
    def _guarded(open_links):
        """A link that cannot start (the host died after it answered the probe) is a lost
        host, as a dropped connection is, not a crash of the head."""
        def opened(nodes):
            links = open_links(nodes)
            for link in links:
                start = link.start

                def guarded(post, request, start=start):
                    try:
                        start(post, request)
                    except Exception as exc:
                        post({"ev": "agent_err", "text": f"cannot start the node agent: {exc}"})
                        post({"ev": "eof"})

                link.start = guarded
            return links
        return opened

    def _current(self) -> List[str]:
        return [n.target for n in self.plan.nodes]

    def _find(self, host: str) -> Optional[str]:
        """A host as the user names it (`h3` or `root@h3`) -> its target in the pool."""
        for target, _ in self._last_pool:
            if host in (target, _name(target)):
                return target
        return None

    # -- requests from the control socket, the agents and the prober -----------------------
    def _control(self, request: Request) -> Tuple[bool, str]:
        with self._lock:
            target = self._find(request.host)
            if target is None:
                known = ", ".join(_name(t) for t, _ in self._last_pool)
                return False, f"{request.host}: not a host of job {self.plan.run_id} (its hosts: {known})"
            if request.cmd == "undrain":
                if target not in self._drained:
                    return False, f"{request.host} is not drained"
                self._drained.discard(target)
                away = self._away.setdefault(target, _Away("lost"))
                away.why, away.failures, away.next_try = "lost", 0, 0.0
                return True, (f"{request.host} may join again: the job grows at its next checkpoint once "
                              f"{request.host} answers")
            current = self._current()
            if target in self._drained:
                return True, f"{request.host} is already draining"
            if target not in current:
                return False, (f"{request.host} is not running in job {self.plan.run_id} "
                               f"(running: {', '.join(_name(t) for t in current)})")
            left = [t for t in current if t not in self._drained and t not in self._leaving and t != target]
            if len(left) < self.spec.min_nodes:
                return False, (f"draining {request.host} would leave {len(left)} host(s), below --min_nodes "
                               f"{self.spec.min_nodes}")
            self._drained.add(target)
            how = self._how()
            self._ask("drain", f"draining {_name(target)} (dslaunch drain): the job {how} and goes on without it")
        self._wake()
        if not self.plan.options.checkpoint_dir:
            how += " (no --checkpoint_dir: steps since the script's own checkpoint are redone)"
        return True, f"draining {request.host}: the job {how} and goes on on {len(left)} host(s)"

    def _how(self) -> str:
        return "saves at the next step boundary" if self.plan.options.checkpoint_dir else "stops at the next step boundary"

    def _ask(self, what: str, note: str) -> None:
        """Under the lock: ask every agent's workers to stop for a resize (a drain wins over a
        grow). `note` is said once every agent has passed the request to its workers: from then
        on the workers act on it at their next optimizer step."""
        self._notes.append(note)
        if self._resize == "drain" or self._resize == what:
            return
        self._resize = what
        self._asks.append(DRAIN if what == "drain" else GROW)
        self._asked_at = time.monotonic()

    def _wake(self) -> None:
        self._events.put((None, {"ev": "wake"}))

    def _elastic_event(self, idx, ev, links) -> None:
        kind = ev.get("ev")
        if kind == "progress":
            with self._lock:
                if isinstance(ev.get("step"), int):
                    self.step = max(self.step or 0, ev["step"])
                if isinstance(ev.get("saved"), int):
                    self.saved = ev["saved"]
                if ev.get("facts"):
                    self.facts = Facts.from_report(ev["facts"])
        elif kind == "leaving" and idx is not None:
            host = links[idx].host
            with self._lock:
                if host in self._leaving:
                    return
                self._leaving.add(host)
                self._ask("drain", f"host {_name(host)} is leaving (its agent got SIGTERM): the job {self._how()} "
                          "and goes on without it")
        elif kind == "asked" and idx is not None:
            with self._lock:
                self._unasked.discard(idx)

    def _elastic_tick(self, links, pending, stop_all) -> None:
        with self._lock:
            asks, self._asks = self._asks, []
            if asks:
                self._unasked = set(pending)
            self._unasked &= set(pending)
            notes = []
            if not self._unasked:
                notes, self._notes = self._notes, []
            overdue = (self._resize == "drain" and not self._resized and not self._forced
                       and self._asked_at is not None and time.monotonic() - self._asked_at > DRAIN_TIMEOUT_S)
        for data in asks:
            for i in pending:
                links[i].send(data)
        for note in notes:
            self.output.say(note)
        if overdue:
            self._forced = self._resized = True
            self.output.say(f"the workers did not stop for the drain within {DRAIN_TIMEOUT_S:g} s (a script "
                            "without the dslaunch runtime?): stopping them; steps since the last checkpoint are redone")
            stop_all()

    def _resize_exit(self, f: Failure) -> bool:
        with self._lock:
            if self._resize is not None and f.exit_code == elastic.RESIZE_EXIT_CODE:
                self._resized = True
                return True
        return False

    # -- the prober ------------------------------------------------------------------------
    def _probe_loop(self) -> None:
        interval = probe_interval(self.timeout)
        while not self._stop_probing.wait(interval):
            try:
                pool = self._pool()
            except Exception:
                pool = None  # the hostfile is being edited: try again next round
            with self._lock:
                if pool:
                    self._last_pool = pool
                current = set(self._current())
                room = self.spec.max_nodes - len(current) - len(self._back)
                now = time.monotonic()
                todo = []
                for target, _ in self._last_pool:
                    if target in current or target in self._back or target in self._drained:
                        continue
                    away = self._away.setdefault(target, _Away("new"))
                    if away.next_try <= now:
                        todo.append(target)
            if room <= 0 or not todo:
                continue
            for target in todo:
                if self._stop_probing.is_set():
                    return
                ok = self._probe(target)
                msg = None
                with self._lock:
                    away = self._away.setdefault(target, _Away("new"))
                    if not ok:
                        away.seen_down = True
                    elif target in self._current() or target in self._drained:
                        pass  # re-planned or drained meanwhile
                    elif target in self._leaving and not away.seen_down:
                        pass  # it is still shutting down: back only once it was gone
                    else:
                        self._leaving.discard(target)
                        self._back.add(target)
                        if self._every:
                            # the workers act on it at their next step at the earliest
                            nxt = steps(-(-(self.step + 1) // self._every) * self._every) if self.step else "?"
                            self._ask("grow", f"{_name(target)} answers again: it joins at the next checkpoint "
                                              f"(step {nxt})")
                        elif self.plan.options.checkpoint_dir:  # no periodic checkpoints: saved at the next step
                            self._ask("grow", f"{_name(target)} answers again: it joins after a checkpoint at the "
                                              "next step")
                        else:
                            msg = (f"{_name(target)} answers again: it joins when the job next restarts "
                                   "(no --checkpoint_dir)")
                    full = len(self._back) >= room
                if msg is not None:
                    self.output.say(msg)
                self._wake()
                if full:
                    break

    # -- the job -----------------------------------------------------------------------------
    def run(self) -> int:
        def on_signal(signum: int, again: bool) -> None:
            self._events.put((None, {"ev": "signal", "sig": signum, "again": again}))

        with StopSignals(on_signal, self._err_fd, self.plan.options.kill_grace) as signals:
            self._signals = signals
            control = ControlServer(self.plan.run_id, self._control)
            prober = threading.Thread(target=self._probe_loop, daemon=True, name="dslaunch-prober")
            prober.start()
            try:
                return self._run(signals)
            finally:
                self._stop_probing.set()
                control.close()

    def _say_start(self) -> None:
        o, n = self.plan.options, len(self.plan.nodes)
        saves = (f"checkpoints every {o.checkpoint_every} steps in {o.checkpoint_dir}" if o.checkpoint_every else
                 f"checkpoints in {o.checkpoint_dir} when hosts change" if o.checkpoint_dir else
                 "no --checkpoint_dir: the script resumes from its own checkpoints")
        self.output.say(f"elastic job {self.plan.run_id}: {n} host(s), between {self.spec.min_nodes} and "
                        f"{self.spec.max_nodes}; {saves}; `dslaunch drain HOST --job {self.plan.run_id}` takes a "
                        "host out")

    def _run(self, signals: StopSignals) -> int:
        o = self.plan.options
        self._say_start()
        restart = failures = 0
        joined: Set[str] = set()  # hosts the last re-plan took in: a loss right away counts against them
        while True:
            if signals.first is not None:
                return 128 + signals.first
            with self._lock:
                self._resized = self._forced = False
            old_world = self.plan.world.world_size
            result = self._attempt(restart)
            restart += 1
            if result.stop_signal is not None or signals.first is not None:
                sig = result.stop_signal or signals.first
                self.output.say(f"stopped by {signal_name(sig)}; all {result.total} worker(s) ended")
                return 128 + sig
            if result.failure is None and not result.resized:
                return result.exit_code
            current = self._current()
            with self._lock:
                step, saved, facts, back = self.step, self.saved, self.facts, set(self._back)
                out = [t for t in current if t in self._drained or t in self._leaving]
                for t in out:
                    self._away[t] = _Away("leaving" if t in self._leaving else "drained")
                self._resize = self._asked_at = None
                self._notes, self._unasked = [], set()  # the attempt's end says what became of them
                if result.lost:
                    lost = [t for t in current if t in result.lost]
                    now = time.monotonic()
                    for t in lost:
                        n = self._join_failures.get(t, 0) + 1 if t in joined else 0
                        self._join_failures[t] = n
                        self._away[t] = _Away("lost", failures=n,
                                              next_try=now + elastic.backoff(n - 1, probe_interval(self.timeout)) if n else now)
                    if len(lost) == 1:
                        event = (f"host {_name(lost[0])} lost at step {steps(step)} "
                                 f"({elastic.lost_reason(result.lost[lost[0]])})")
                    else:
                        event = f"hosts {', '.join(_name(t) for t in lost)} lost at step {steps(step)}"
                    keep = [t for t in current if t not in lost and t not in out]
                elif result.resized:
                    keep = [t for t in current if t not in out]
                    if out:
                        how = "left (its agent got SIGTERM)" if all(t in self._leaving for t in out) else "drained"
                        event = f"host{'s' if len(out) > 1 else ''} {', '.join(_name(t) for t in out)} {how} " \
                                f"at step {steps(step)}"
                    else:
                        event = f"growing at step {steps(saved)}"
                else:
                    keep = None
            if keep is None:  # a worker failed on a host that is still there: the fixed-size policy
                self.output.summary(AttemptSummary(result.failure, result.ended, result.total))
                if failures >= o.max_restarts:
                    if o.max_restarts:
                        self.output.say(f"giving up after {o.max_restarts} restart(s)")
                    return result.exit_code
                failures += 1
                event = f"restarting every worker (restart {failures} of {o.max_restarts})"
                if not out and not back:
                    self.output.say(event)
                    continue
                keep = [t for t in current if t not in out]
            candidates = in_order(set(keep) | back, [t for t, _ in self._last_pool])
            slots = dict(self._last_pool)
            for n in self.plan.nodes:
                slots.setdefault(n.target, n.node.local_world_size)
            choice = choose_hosts(candidates, slots, self.spec, facts)
            if choice is None:
                self.output.say(f"{event}; {elastic.why_no_choice(candidates, slots, self.spec, facts)}: giving up")
                return elastic_failure_code(result)
            joined = {t for t in choice.hosts if t not in current}
            with self._lock:
                self._back -= set(choice.hosts)
                for t in choice.hosts:
                    self._away.pop(t, None)
                self.step = saved
            if joined and not out and not result.lost and result.resized:
                names = ", ".join(_name(t) for t in in_order(joined, candidates))
                event = (f"{names} {'is' if len(joined) == 1 else 'are'} back; growing to {len(choice.hosts)} hosts "
                         f"at step {steps(saved)}")
            gas = (facts.accumulation(old_world), facts.accumulation(choice.world))
            self.output.say(f"{event}; " + resume_clause(len(choice.hosts), self.spec.max_nodes, saved,
                                                         bool(o.checkpoint_dir), gas))
            self.plan = self._rebuild(choice.hosts)


def elastic_failure_code(result) -> int:
    """The exit code of a job that cannot go on: a lost host's (255, as ssh), else the
    failed worker's, else 255 (a drain that left too few hosts)."""
    if result.lost or result.failure is None:
        return HOST_FAILURE_CODE
    return result.failure.exit_code
