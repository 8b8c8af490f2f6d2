"""Test worker (no torch): behaves as its argv says, per rank. Used by the supervisor/launch tests.

    behave.py [--local_rank=N] ACTION [ARGS...]
ACTIONS
    ok                       exit 0
    lines N                  N numbered lines to stdout and to stderr, in many small writes
    exit RANK CODE           rank RANK exits CODE after 0.3 s; the others wait to be stopped
    kill RANK SIG            rank RANK kills itself with signal SIG; the others wait
    tree PIDFILE MODE        spawn a child, a setsid'd child and an orphaned grandchild that sleep,
                             record this rank's tree in PIDFILE.<rank>, wait for every rank's file
                             and then for PIDFILE.go (the test's census of the tree is done);
                             MODE: wait | ignore (the whole tree ignores SIGTERM and SIGINT,
                             rank 1 exits 5) | ignore_wait (the same, nobody fails)
                             | exit:CODE (rank 1 exits CODE) | signal:N (rank 1 kills itself)
    env OUT                  write the worker's argv and environment as JSON to OUT.<rank>
    args                     print the script's argv as JSON on one line
"""
import json
import os
import signal
import subprocess
import sys
import time

argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]
rank = int(os.environ.get("RANK", "0"))
action = argv[0] if argv else "ok"


def wait_forever():
    # Bounded so a broken test can never leave a process behind for long.
    time.sleep(120)
    sys.exit(99)


def ready(tag):
    print(f"ready {tag}", flush=True)


if action == "ok":
    pass
elif action == "lines":
    n = int(argv[1])
    for i in range(n):
        # Several writes per line: the supervisor must still deliver whole lines.
        for part in (f"r{rank} ", f"line {i} ", "end\n"):
            sys.stdout.write(part)
            sys.stdout.flush()
            sys.stderr.write("E" + part)
            sys.stderr.flush()
    sys.stdout.write(f"r{rank} no-newline-at-end")
elif action == "exit":
    ready(rank)
    if rank == int(argv[1]):
        time.sleep(0.3)
        print(f"rank {rank} is failing", file=sys.stderr, flush=True)
        sys.exit(int(argv[2]))
    wait_forever()
elif action == "kill":
    ready(rank)
    if rank == int(argv[1]):
        time.sleep(0.3)
        os.kill(os.getpid(), int(argv[2]))
    wait_forever()
elif action == "tree":
    pidfile = f"{argv[1]}.{rank}"
    mode = argv[2]
    ignore = mode.startswith("ignore")
    deaf = "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    sleeper = "import signal,time\n" + (deaf if ignore else "") + "time.sleep(120)"
    if ignore:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", sleeper])
    escaped = subprocess.Popen([sys.executable, "-c", sleeper], start_new_session=True)
    # The grandchild's parent exits at once, orphaning it: only a subreaper can still find it.
    orphaner = subprocess.Popen([sys.executable, "-c",
                                 f"import subprocess,sys; p=subprocess.Popen([sys.executable,'-c',{sleeper!r}], stdout=subprocess.DEVNULL); print(p.pid)"],
                                stdout=subprocess.PIPE, text=True)
    orphan = int(orphaner.communicate()[0])
    with open(pidfile + ".tmp", "w") as f:
        json.dump([os.getpid(), child.pid, escaped.pid, orphan], f)
    os.replace(pidfile + ".tmp", pidfile)
    world = int(os.environ["WORLD_SIZE"])
    # Act only once the test has counted every process: a rank that failed earlier would end
    # the job (and its watchdog) while the census is being taken.
    while not all(os.path.exists(f"{argv[1]}.{r}") for r in (*range(world), "go")):
        time.sleep(0.02)
    ready(rank)
    if rank == 1 and mode not in ("wait", "ignore_wait"):
        print(f"rank {rank} is failing ({mode})", file=sys.stderr, flush=True)
        if mode.startswith("signal:"):
            os.kill(os.getpid(), int(mode.split(":")[1]))
        sys.exit(5 if ignore else int(mode.split(":")[1]))
    wait_forever()
elif action == "env":
    with open(f"{argv[1]}.{rank}", "w") as f:
        json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)
elif action == "args":
    print(json.dumps(sys.argv[1:]))
else:
    sys.exit(f"behave.py: unknown action {action!r}")
