"""Facts about this machine that the plan depends on: GPUs, host names, free ports.

Kept apart from the pure plan so tests can hand the planner any machine they like.
Nothing here imports torch: GPUs are counted from the driver's /proc entries.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")


@dataclass(frozen=True)
class MachineFacts:
    gpu_count: int
    visible_devices: Optional[List[str]]  # the CUDA_VISIBLE_DEVICES list we inherited, if any
    cpu_count: int
    hostnames: Sequence[str]  # names and addresses that mean this machine
    python: str = sys.executable
    cwd: str = field(default_factory=os.getcwd)
    home: str = field(default_factory=lambda: str(Path.home()))


def detect_gpus(environ: Mapping[str, str], driver_dir: str = "/proc/driver/nvidia/gpus",
                dev_dir: str = "/dev") -> "tuple[int, Optional[List[str]]]":
    """(GPU count, inherited CUDA_VISIBLE_DEVICES list or None), without CUDA or torch.

    No NVIDIA driver means no GPUs, whatever CUDA_VISIBLE_DEVICES says. With a driver,
    CUDA_VISIBLE_DEVICES (when set) narrows the devices as CUDA would: its entries up
    to the first invalid one ('-1' hides everything after it).
    """
    try:
        physical = len([e for e in os.listdir(driver_dir)])
    except OSError:
        try:
            physical = len([e for e in os.listdir(dev_dir) if e.startswith("nvidia") and e[6:].isdigit()])
        except OSError:
            physical = 0
    if physical == 0:
        return 0, None
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return physical, None
    visible: List[str] = []
    for entry in cvd.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        visible.append(entry)
    return len(visible), visible


def local_names() -> List[str]:
    names = list(LOOPBACK_NAMES)
    host = socket.gethostname()
    names += [host, host.split(".")[0]]
    return names


def local_addresses() -> List[str]:
    """Addresses of this machine's interfaces (psutil is imported only when a hostfile needs it)."""
    import psutil

    return [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)]


def is_local(host: str, names: Sequence[str]) -> bool:
    """True when `host` names this machine. No DNS: a lookup could stall a dry run for seconds."""
    return host in names or host.startswith("127.")


def gather_facts(environ: Mapping[str, str], need_addresses: bool) -> MachineFacts:
    gpus, visible = detect_gpus(environ)
    names = local_names()
    if need_addresses:
        names += local_addresses()
    return MachineFacts(gpus, visible, os.cpu_count() or 1, tuple(dict.fromkeys(names)))


def port_in_use(addr: str, port: int) -> bool:
    """True when something listens on addr:port here, so a rendezvous store could not bind
    it. SO_REUSEADDR, as the store's own socket: a port a finished job left in TIME_WAIT is free."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
        return False


def pick_free_port(addr: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on addr (the OS picks it), as torchrun does for port 0."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]
