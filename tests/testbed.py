"""A small SSH cluster on one machine, built from Linux network namespaces.

Each "host" is a network namespace on a bridge with its own address, its own hostname
(a private UTS namespace), its own /etc/hosts (bind-mounted inside the namespace's private
mount namespace) and its own OpenSSH server started with `-D` so it stays our child.
The root namespace owns the bridge address `<subnet>.1`; host N is `<subnet>.(10+N)`.

Everything the cluster needs lives in one temporary folder: a throwaway client key, a host
key, an `authorized_keys`, a `known_hosts` that lists every host, and a `ssh_config`.

Why namespaces share the PID namespace with us: every remote process is visible in /proc
here, which is what lets the tests prove that no host keeps an orphan.

The module is importable by path (scripts/bench_multinode.py does that), so it depends
only on the standard library.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import kernel_paths

SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by absolute path


class TestbedUnavailable(RuntimeError):
    """The machine cannot host the cluster (not root, no sshd, no iproute2, ...)."""


class SubnetInUse(TestbedUnavailable):
    """Another cluster (another test session, a benchmark) already uses this subnet."""


@dataclass
class Host:
    name: str   # hostname inside the namespace
    ip: str
    netns: str
    veth: str   # root-side end; deleting it removes the pair synchronously


@dataclass
class Testbed:
    prefix: str
    subnet: str                      # "10.213.7" -> a /24
    dir: Path
    hosts: List[Host] = field(default_factory=list)
    _sshds: List[subprocess.Popen] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br0"

    @property
    def root_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def key(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def unused_ip(self) -> str:
        """An address on the bridge's subnet that nobody answers: connects to it time out."""
        return f"{self.subnet}.99"

    def host_pids(self) -> List[int]:
        """Every live process inside any host namespace (sshd included)."""
        pids: List[int] = []
        for h in self.hosts:
            out = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split() if _alive(int(p))]
        return pids

    def sshd_pids(self) -> List[int]:
        return [p.pid for p in self._sshds]

    def ssh_env(self, home: Path) -> dict:
        """An environment whose HOME holds ~/.ssh/{config,known_hosts,id_ed25519} for this cluster."""
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.known_hosts, ssh_dir / "known_hosts")
        shutil.copy(self.key, ssh_dir / "id_ed25519")
        os.chmod(ssh_dir / "id_ed25519", 0o600)
        lines = []
        for h in self.hosts:
            lines += [f"Host {h.name}", f"    HostName {h.ip}", "    User root", ""]
        lines += ["Host *", f"    IdentityFile {ssh_dir / 'id_ed25519'}", "    BatchMode yes", ""]
        (ssh_dir / "config").write_text("\n".join(lines))
        env = dict(os.environ)
        env["HOME"] = str(home)
        return env

    # ------------------------------------------------------------------ lifecycle
    def build(self, n_hosts: int) -> "Testbed":
        _check_prerequisites()
        if not (1 <= n_hosts <= 9):
            raise ValueError("n_hosts must be 1..9")
        # Checked before anything is touched: a live cluster of a concurrent session must survive us.
        if subprocess.run(["ip", "route", "show", f"{self.subnet}.0/24"], capture_output=True, text=True).stdout.strip():
            raise SubnetInUse(f"{self.subnet}.0/24 is already routed here; pick another subnet")
        self.teardown(quiet=True)  # half-built leftovers (namespaces without a bridge) of the same prefix
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd refuses to start without it
        os.chmod("/run/sshd", 0o755)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hosts = [
            Host(f"{self.prefix}-h{i}", f"{self.subnet}.{10 + i}", f"{self.prefix}-h{i}", f"{self.prefix}-h{i}-br")
            for i in range(1, n_hosts + 1)
        ]
        # The bridge is the claim on the prefix: if a concurrent session created it first, back off
        # without touching anything of theirs.
        claim = subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], capture_output=True, text=True)
        if claim.returncode != 0:
            raise SubnetInUse(f"cannot create bridge {self.bridge}: {claim.stderr.strip()}")
        try:
            self._make_keys()
            self._make_network()
            self._start_sshds()
        except BaseException:
            self.teardown(quiet=True)
            raise
        return self

    def _make_keys(self) -> None:
        for path in (self.key, self.dir / "host_key"):
            if not path.exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.prefix, "-f", str(path)])
        shutil.copy(f"{self.key}.pub", self.dir / "authorized_keys")
        host_pub = (self.dir / "host_key.pub").read_text().split()
        self.known_hosts.write_text(
            "".join(f"{h.ip} {host_pub[0]} {host_pub[1]}\n{h.name} {host_pub[0]} {host_pub[1]}\n" for h in self.hosts)
        )
        hosts = ["127.0.0.1 localhost", f"{self.root_ip} {self.prefix}-root"]
        hosts += [f"{h.ip} {h.name}" for h in self.hosts]
        (self.dir / "hosts").write_text("\n".join(hosts) + "\n")

    def _make_network(self) -> None:
        _run(["ip", "addr", "add", f"{self.root_ip}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            inner = f"{h.netns}-in"
            _run(["ip", "netns", "add", h.netns])
            _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", h.netns])
            _run(["ip", "link", "set", h.veth, "master", self.bridge])
            _run(["ip", "link", "set", h.veth, "up"])
            # the same interface name on every host, so GLOO_SOCKET_IFNAME=eth0 works everywhere
            _run(["ip", "-n", h.netns, "link", "set", inner, "name", "eth0"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])  # a new namespace's loopback is down

    def _start_sshd(self, h: Host) -> subprocess.Popen:
        conf = self.dir / f"sshd-{h.name}.conf"
        pidfile = self.dir / f"sshd-{h.name}.pid"
        pidfile.unlink(missing_ok=True)
        conf.write_text(_SSHD_CONFIG.format(ip=h.ip, dir=self.dir, name=h.name) + kernel_paths.sshd_setenv())
        script = (
            f"mount --bind {self.dir}/hosts /etc/hosts && hostname {h.name} && "
            f"exec {SSHD} -D -f {conf} -E {self.dir}/sshd-{h.name}.log"
        )
        # its own session, and only PATH from our environment: a signal to a test's process
        # group, or a launcher's clean-up of processes carrying its job marker, never reaches it
        return subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
        )

    def _start_sshds(self) -> None:
        for h in self.hosts:
            self._sshds.append(self._start_sshd(h))
        self._wait_listening(self.hosts, self._sshds)

    def crash_host(self, i: int) -> None:
        """Host i goes down hard: SIGKILL to every process in its namespace, its sshd included
        (its connections close, as a machine's do when it dies)."""
        h = self.hosts[i]
        out = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout
        for pid in (int(p) for p in out.split()):
            _kill(pid, signal.SIGKILL)
        try:
            self._sshds[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart_host(self, i: int) -> None:
        """Host i comes back: its sshd listens again."""
        self._sshds[i] = self._start_sshd(self.hosts[i])
        self._wait_listening([self.hosts[i]], [self._sshds[i]])

    def _wait_listening(self, hosts: List[Host], procs: List[subprocess.Popen]) -> None:
        # sshd writes its PidFile only once it listens
        deadline = time.monotonic() + 10
        for h, proc in zip(hosts, procs):
            pidfile = self.dir / f"sshd-{h.name}.pid"
            while not (pidfile.exists() and pidfile.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / f"sshd-{h.name}.log")
                    tail = log.read_text()[-400:] if log.exists() else ""
                    raise TestbedUnavailable(f"sshd in {h.netns} did not start: {tail.strip()}")
                time.sleep(0.02)

    def teardown(self, quiet: bool = False) -> None:
        """Kill every process in the host namespaces, then delete links, namespaces, bridge."""
        names = _existing_netns(self.prefix)
        pids = []
        for ns in names:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split()]
        for pid in pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if _alive(pid):
                _kill(pid, signal.SIGKILL)
        for proc in self._sshds:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._sshds.clear()
        for ns in names:
            subprocess.run(["ip", "link", "del", f"{ns}-br"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


_SSHD_CONFIG = """\
ListenAddress {ip}
Port 22
HostKey {dir}/host_key
PidFile {dir}/sshd-{name}.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 200
MaxSessions 100
LogLevel VERBOSE
"""


def _run(cmd: List[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise TestbedUnavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _existing_netns(prefix: str) -> List[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(f"{prefix}-h")]


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise TestbedUnavailable("the SSH test cluster needs root (network namespaces)")
    missing = [tool for tool in (SSHD, "ip", "unshare", "ssh-keygen") if not shutil.which(tool)]
    if missing:
        raise TestbedUnavailable(
            f"missing {', '.join(missing)}: run scripts/setup_system.sh (openssh-server, iproute2)"
        )


def build(prefix: str, subnet: str, n_hosts: int, directory: Optional[Path] = None) -> Testbed:
    """Build a cluster; the caller must call teardown() (use try/finally)."""
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix=f"{prefix}-testbed-"))
    return Testbed(prefix=prefix, subnet=subnet, dir=d).build(n_hosts)


def build_free(tag: str, first: int, count: int, n_hosts: int, directory: Optional[Path] = None) -> Testbed:
    """Build on the first free subnet 10.213.X, X in [first, first+count), starting at a pid-derived
    offset, so concurrent sessions (tests and benchmarks on one machine) never share one."""
    start = os.getpid() % count
    for k in range(count):
        x = first + (start + k) % count
        try:
            return build(f"{tag}{x}", f"10.213.{x}", n_hosts, directory)
        except SubnetInUse:
            continue
    raise TestbedUnavailable(f"no free subnet among 10.213.{first}-{first + count - 1}")
