"""A signal the kernel delivers to another thread than the main one (a node agent has an
output writer, a heartbeat and a control reader running) still reaches the supervisor's
caller at once: its handler runs in the main thread, which is asleep in the supervisor's
select(); the supervisor sets the wakeup fd, so the loop wakes and the handler runs. Without
it the handler waited for something else to wake the loop: an elastic node agent heard a
SIGTERM only at its heartbeat timeout (60 s), after the head had been declared lost."""
import subprocess
import sys

SCRIPT = r"""
import os, signal, sys, threading, time
from dslaunch.launcher.supervisor import Supervisor, WorkerSpec

class Quiet:
    def line(self, line): pass
    def failed(self, failure): pass
    def exited(self, label): pass

sup = Supervisor([WorkerSpec(0, [sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ))],
                 Quiet(), kill_grace=2.0, subreaper=False)
signal.signal(signal.SIGUSR1, lambda *_: sup.request_stop(signal.SIGTERM))

def side():
    time.sleep(1.0)  # the loop is asleep in select() by now
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # delivered to this thread, not the main one

threading.Thread(target=side, daemon=True).start()
result = sup.run()
print("stopped", result.stop_signal == signal.SIGTERM, flush=True)
"""


def test_a_signal_delivered_to_another_thread_wakes_the_supervisor():
    # without the wakeup fd the worker's 300 s sleep decides when run() returns: far past 120 s
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "stopped True"
