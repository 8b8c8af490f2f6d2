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
    flood OUT MODE           record SIGTERM/SIGINT arrival in OUT.stopped.<rank> and exit; rank 0
                             floods stdout (bytes so far in OUT.bytes); MODE fail: rank 1 exits 3
                             once OUT.go exists (the time in OUT.failed)
    cascade OUT MODE         torch-style `[rankN]: ` tracebacks. MODE victim: rank 1 fails with a
                             config error, then rank 0 (deaf to SIGTERM) prints a follow-on
                             "Connection closed by peer" traceback and exits 1. MODE same: both
                             print the same config error, rank 0 first, but rank 1 exits first
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


def write_whole(path, text):
    """A test polls for these files and reads them once they exist: write elsewhere and rename,
    so the name never appears before its contents."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


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
    write_whole(pidfile, json.dumps([os.getpid(), child.pid, escaped.pid, orphan]))
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
elif action == "flood":
    out, mode = argv[1], argv[2]

    def stopped(signum, frame):
        write_whole(f"{out}.stopped.{rank}", repr(time.time()))
        os._exit(0)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    open(f"{out}.ready.{rank}", "w").close()
    if rank == 1:
        if mode == "fail":
            while not os.path.exists(f"{out}.go"):
                time.sleep(0.01)
            write_whole(f"{out}.failed", repr(time.time()))
            sys.exit(3)
        wait_forever()
    line = "x" * 200 + "\n"
    written = 0
    while True:
        for _ in range(1000):
            sys.stdout.write(line)
        written += 1000 * len(line)
        write_whole(f"{out}.bytes", str(written))
elif action == "cascade":
    out, mode = argv[1], argv[2]

    def traceback_lines(r, error):
        return "".join(f"[rank{r}]: {t}\n" for t in (
            "Traceback (most recent call last):", '  File "train.py", line 7, in <module>', f"    {error}", error))

    def wait_for(name):
        while not os.path.exists(f"{out}.{name}"):
            time.sleep(0.01)

    config_error = "ValueError: ds_config: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)"
    print(f"rank {rank} starting", flush=True)
    if mode == "victim":
        if rank == 0:
            open(f"{out}.starting", "w").close()
        if rank == 1:
            # rank 0's "starting" line comes before this failure: once it is printed, a moment
            # for the launcher to read it (under load rank 1 could otherwise fail first)
            wait_for("starting")
            time.sleep(0.5)
            sys.stderr.write(traceback_lines(1, config_error))
            sys.stderr.flush()
            open(f"{out}.failing", "w").close()
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        wait_for("failing")
        time.sleep(0.2)  # rank 1 is gone: what follows is a follow-on error
        sys.stderr.write(traceback_lines(0, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"))
        sys.stderr.flush()
        sys.exit(1)
    if rank == 0:
        wait_for("started")
        sys.stderr.write(traceback_lines(0, config_error))
        sys.stderr.flush()
        open(f"{out}.printed", "w").close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(0.5)
        sys.exit(1)
    open(f"{out}.started", "w").close()
    wait_for("printed")
    sys.stderr.write(traceback_lines(1, config_error))
    sys.stderr.flush()
    sys.exit(1)
elif action == "env":
    with open(f"{argv[1]}.{rank}", "w") as f:
        json.dump({"argv": sys.argv, "env": dict(os.environ)}, f)
elif action == "args":
    print(json.dumps(sys.argv[1:]))
else:
    sys.exit(f"behave.py: unknown action {action!r}")
