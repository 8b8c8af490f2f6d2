"""reaper.descendants walks the kernel's per-thread children lists; the reference is the
scan of every /proc/*/stat it replaced (reaper._parent_map), which must give the same tree.

The tree is built in a process of its own, which makes itself a child subreaper (pytest's
process must not adopt orphans): a worker with a child, a daemon that left the worker's
session and was orphaned (re-parented to the subreaper), and a child forked by a thread
other than the main one (it hangs on that thread's list, not the process's).
"""
import json
import subprocess
import sys
import time

import pytest

from dslaunch.launcher import reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")

TREE = r"""
import json, os, signal, subprocess, sys, threading, time
from dslaunch.launcher import reaper

assert reaper.become_subreaper()
me = os.getpid()
# the worker: a child of its own (sleep 60), a daemon that setsid-escapes and is orphaned
# when its subshell exits (sleep 61, re-parented to us), and then the worker itself (sleep 62)
worker = subprocess.Popen(["sh", "-c", "sleep 60 & (setsid sleep 61 &); exec sleep 62"])
held, spawned = threading.Event(), threading.Event()
from_thread = {}

def spawn_and_hold():
    from_thread["proc"] = subprocess.Popen(["sleep", "63"])
    spawned.set()
    held.wait()

# a daemon thread: if an assertion below fails, the process exits with it instead of waiting on `held`
t = threading.Thread(target=spawn_and_hold, daemon=True)
t.start()

def scan(p, exclude=()):
    reaper._children_files = False  # the full /proc scan: the reference
    try:
        return sorted(reaper.descendants(p, exclude))
    finally:
        reaper._children_files = None

def commands(pids):
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                out.append(fh.read().rstrip(b"\0").replace(b"\0", b" ").decode())
        except OSError:
            out.append("gone")
    return sorted(out)

# wait for exactly the four sleeps: until then the tree also holds short-lived shells (sh before its
# exec, the subshell that starts the daemon), and the thread may not have started its child yet
SLEEPS = ["sleep 60", "sleep 61", "sleep 62", "sleep 63"]
deadline = time.monotonic() + 20
while not (spawned.is_set() and commands(scan(me)) == SLEEPS) and time.monotonic() < deadline:
    time.sleep(0.02)
assert spawned.is_set() and commands(scan(me)) == SLEEPS, commands(scan(me))
out = {"has_lists": reaper._has_children_files(), "reference": scan(me),
       "walk": sorted(reaper.descendants(me)), "worker": worker.pid,
       "thread_child": from_thread["proc"].pid,
       "children": sorted(reaper.children(me)),
       "excluded": sorted(reaper.descendants(me, exclude=[from_thread["proc"].pid]))}
tid = t.native_id
held.set()
t.join()
# join() returns before the kernel has finished the thread: its child moves to the list of a
# thread still alive while the thread exits, so walk once its task is gone from /proc
deadline = time.monotonic() + 20
while os.path.exists(f"/proc/{me}/task/{tid}") and time.monotonic() < deadline:
    time.sleep(0.01)
assert not os.path.exists(f"/proc/{me}/task/{tid}"), "the thread never ended"
out["after_thread_exit"] = sorted(reaper.descendants(me))
reaper.signal_processes(reaper.descendants(me), signal.SIGKILL)
deadline = time.monotonic() + 20
left = reaper.descendants(me)
while [p for p in left if reaper.alive(p)] and time.monotonic() < deadline:
    time.sleep(0.02)
    left = reaper.descendants(me)
out["alive_after_kill"] = [p for p in left if reaper.alive(p)]
reaper.reap(p for p in reaper.children(me) if p not in (worker.pid, from_thread["proc"].pid))
worker.wait()
from_thread["proc"].wait()
print(json.dumps(out))
"""


def test_descendants_match_the_full_proc_scan_and_all_are_killed():
    proc = subprocess.run([sys.executable, "-c", TREE], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["has_lists"], "this kernel has no /proc/PID/task/TID/children: only the fallback was tested"
    ref = out["reference"]
    # sleep 60 (the worker's child), sleep 61 (the orphaned daemon), the worker, sleep 63
    assert len(ref) == 4, out
    assert out["walk"] == ref
    # direct children: the worker, the adopted daemon and the thread's child, not sleep 60
    assert len(out["children"]) == 3 and {out["worker"], out["thread_child"]} <= set(out["children"]), out
    assert out["excluded"] == sorted(set(ref) - {out["thread_child"]})
    assert out["after_thread_exit"] == ref
    assert out["alive_after_kill"] == []


def test_a_pid_that_is_gone_has_no_children():
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert reaper.children(proc.pid) == [] and reaper.descendants(proc.pid) == []


def test_exiting_is_true_for_a_zombie_and_false_for_a_running_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not reaper.exiting(proc.pid)
    finally:
        proc.kill()
    # killed and not yet waited for: a zombie until wait() below
    deadline = time.monotonic() + 20
    while not reaper.exiting(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reaper.exiting(proc.pid)
    proc.wait()
    assert not reaper.exiting(proc.pid)  # gone
