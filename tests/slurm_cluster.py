"""A Slurm cluster on the network-namespace test bed (tests/testbed.py): munged and
slurmctld in our namespace, one slurmd in each host namespace.

Everything lives in one folder: the munge key and socket, slurm.conf, the controller's
state, each slurmd's spool directory and every log. The daemons run in the foreground
(`-D`, `-F`) as our children, so stop() ends exactly them, by PID.

Why slurmd is not started with `ip netns exec` as sshd is: that command mounts a fresh
/sys, without the cgroup file systems, and slurmd 22.05 refuses to start without them
("No filesystem mounted on /sys/fs/cgroup"). `nsenter --net` enters the host's network
namespace and keeps /sys; `unshare --mount --uts` gives the host its own hostname and
/etc/hosts, as the sshds have. Tasks inherit all three from slurmd.

Standard library only, like testbed.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from testbed import Testbed, TestbedUnavailable

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "nsenter")
CPUS = 4  # per node, as slurm.conf declares it (config_overrides: the hardware may have fewer)

_CONF = """\
ClusterName={cluster}
SlurmctldHost={ctld_host}({root_ip})
SlurmctldPort={ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=2
MessageTimeout=10
SlurmdTimeout=30
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    tb: Testbed
    dir: Path
    _daemons: List[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    def env(self, base: Dict[str, str]) -> Dict[str, str]:
        return {**base, "SLURM_CONF": str(self.conf)}

    def daemon_pids(self) -> List[int]:
        return [p.pid for p in self._daemons]

    def start(self) -> "SlurmCluster":
        missing = [t for t in TOOLS if not shutil.which(t)]
        if missing:
            raise TestbedUnavailable(f"missing {', '.join(missing)}: run scripts/setup_system.sh (slurm-wlm, munge)")
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        with socket.socket() as s:  # the controller listens in our namespace: ask the OS for a free port
            s.bind((self.tb.root_ip, 0))
            port = s.getsockname()[1]
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.ip} CPUs={CPUS} State=UNKNOWN" for h in self.tb.hosts)
        self.conf.write_text(_CONF.format(cluster=self.tb.prefix, ctld_host=socket.gethostname(),
                                          root_ip=self.tb.root_ip, ctld_port=port, dir=self.dir, nodes=nodes))
        try:
            self._spawn(["munged", "-F", "-f", f"--key-file={key}", f"--socket={self.dir}/munge.sock",
                         f"--pid-file={self.dir}/munged.pid", f"--seed-file={self.dir}/munged.seed",
                         f"--log-file={self.dir}/munged.log"], "munged")
            self._wait(lambda: (self.dir / "munge.sock").exists(), "munged did not create its socket")
            self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for h in self.tb.hosts:
                (self.dir / f"spool-{h.name}").mkdir(exist_ok=True)
                script = (f"mount --bind {self.tb.dir}/hosts /etc/hosts && hostname {h.name} && "
                          f"exec slurmd -D -f {self.conf}")
                self._spawn(["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--uts",
                             "sh", "-c", script], f"slurmd-{h.name}")
            self._wait(self._all_idle, "the slurmds did not register as idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, argv: List[str], name: str) -> None:
        out = open(self.dir / f"{name}.out", "wb")
        self._daemons.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
        out.close()

    def _all_idle(self) -> bool:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(dict(os.environ)),
                             capture_output=True, text=True)
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(h.name) == "idle" for h in self.tb.hosts)

    def _wait(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = " | ".join(f"{f.name}: {f.read_text()[-300:].strip()}" for f in sorted(self.dir.glob("*.out")))
                raise TestbedUnavailable(f"{what}: {logs}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM every daemon we started (slurmds first), then SIGKILL what is left after 5 s."""
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in reversed(self._daemons):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()


def start(tb: Testbed, directory: Path) -> SlurmCluster:
    return SlurmCluster(tb, Path(directory)).start()
