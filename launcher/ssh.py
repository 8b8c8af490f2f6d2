"""SSH transport for multi-node launches, on paramiko.

Resolves where to connect (hostfile `user@host`, the `--ssh_*` options and the user's
~/.ssh/config, in OpenSSH's precedence: command line over config over defaults), checks
host keys against known_hosts, and opens connections to all hosts in parallel so that one
slow or dead host costs its own timeout, never the sum of everyone's.

Every failure becomes an `SshError` whose message starts with the host it concerns:
the launcher prints it as one line and exits, never with a traceback.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import paramiko

from dslaunch.launcher.hostfile import split_user
from dslaunch.launcher.options import SshOptions


class SshError(RuntimeError):
    def __init__(self, host: str, message: str):
        super().__init__(f"{host}: {message}")
        self.host = host


@dataclass(frozen=True)
class SshTarget:
    """One host, fully resolved: what paramiko needs to connect to it."""
    alias: str                 # the name in the hostfile (user@ stripped); used in messages
    hostname: str              # what we actually connect to (config HostName)
    port: int
    user: str
    key_files: Tuple[str, ...] = ()
    known_hosts_files: Tuple[str, ...] = ()
    proxy_command: Optional[str] = None


def load_config(path: Optional[str]) -> paramiko.SSHConfig:
    p = Path(path).expanduser() if path else Path("~/.ssh/config").expanduser()
    if not p.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(p))
    except Exception as exc:  # a broken config must name itself, not crash the launcher
        raise SshError(str(p), f"cannot parse ssh config: {exc}") from None


def _default_user() -> str:
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return os.environ.get("USER", "root")


def resolve(host: str, opts: SshOptions, config: Optional[paramiko.SSHConfig] = None) -> SshTarget:
    """Resolve one hostfile entry into a connect target (pure apart from reading the config)."""
    config = config if config is not None else load_config(opts.config_path)
    hf_user, alias = split_user(host)
    cfg = config.lookup(alias)
    user = opts.user or hf_user or cfg.get("user") or _default_user()
    try:
        port = int(opts.port or cfg.get("port") or 22)
    except ValueError:
        raise SshError(alias, f"bad Port in ssh config: {cfg.get('port')!r}") from None
    if opts.key:
        keys: List[str] = [opts.key]
    else:
        keys = [os.path.expanduser(k) for k in cfg.get("identityfile", [])]
    known = [os.path.expanduser(k) for k in str(cfg.get("userknownhostsfile", "")).split() if k]
    if not known:
        known = [os.path.expanduser("~/.ssh/known_hosts")]
    return SshTarget(
        alias=alias,
        hostname=cfg.get("hostname", alias),
        port=port,
        user=user,
        key_files=tuple(keys),
        known_hosts_files=tuple(known),
        proxy_command=cfg.get("proxycommand"),
    )


class _UnknownKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuses unknown keys with a message saying how to accept them, or accepts and records them."""

    def __init__(self, target: SshTarget, accept: bool):
        self.target = target
        self.accept = accept
        self.lock = threading.Lock()

    def missing_host_key(self, client, hostname, key):
        fp = key.fingerprint if hasattr(key, "fingerprint") else key.get_base64()[:16]
        if not self.accept:
            raise SshError(
                self.target.alias,
                f"host key {key.get_name()} {fp} is not in known_hosts ({', '.join(self.target.known_hosts_files)}); "
                "refusing to connect (check it, then rerun with --accept_new_host_keys to trust it)",
            )
        # Record the key in the user's first known_hosts file, as `ssh -o StrictHostKeyChecking=accept-new` does.
        path = Path(self.target.known_hosts_files[0])
        with self.lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def connect(target: SshTarget, opts: SshOptions) -> paramiko.SSHClient:
    """Open an authenticated connection or raise SshError naming the host."""
    client = paramiko.SSHClient()
    for kh in target.known_hosts_files:
        if os.path.isfile(kh):
            try:
                client.load_host_keys(kh)
            except Exception as exc:
                raise SshError(target.alias, f"cannot read known_hosts file {kh}: {exc}") from None
    client.set_missing_host_key_policy(_UnknownKeyPolicy(target, opts.accept_new_host_keys))
    sock = None
    if target.proxy_command:
        sock = paramiko.ProxyCommand(target.proxy_command)
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.key_files) or None,
            timeout=opts.timeout,
            banner_timeout=opts.timeout,
            auth_timeout=opts.timeout,
            sock=sock,
        )
    except SshError:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise SshError(
            target.alias,
            f"HOST KEY MISMATCH: the server's {exc.key.get_name()} key {exc.key.fingerprint} differs from "
            f"the one in known_hosts; refusing to connect (someone may be intercepting the connection, "
            f"or the host was reinstalled: fix known_hosts by hand)",
        ) from None
    except paramiko.AuthenticationException as exc:
        client.close()
        raise SshError(target.alias, f"authentication failed as user {target.user!r}: {exc}") from None
    except (socket.timeout, TimeoutError):
        client.close()
        raise SshError(
            target.alias, f"connect to {target.hostname}:{target.port} timed out after {opts.timeout:g}s (--ssh_timeout)"
        ) from None
    except socket.gaierror as exc:
        client.close()
        raise SshError(target.alias, f"cannot resolve {target.hostname}: {exc.strerror}") from None
    except paramiko.ssh_exception.NoValidConnectionsError as exc:
        client.close()
        why = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()})) or "refused"
        raise SshError(target.alias, f"cannot connect to {target.hostname}:{target.port}: {why}") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        client.close()
        raise SshError(target.alias, f"cannot connect to {target.hostname}:{target.port}: {exc or type(exc).__name__}") from None
    transport = client.get_transport()
    if transport is not None:
        # notice a dead peer (cable pulled, host down) instead of waiting forever on a silent socket
        transport.set_keepalive(5)
    return client


@dataclass
class ConnectResult:
    clients: Dict[str, paramiko.SSHClient] = field(default_factory=dict)
    errors: Dict[str, SshError] = field(default_factory=dict)
    connect_ms: Dict[str, float] = field(default_factory=dict)  # TCP + SSH handshake + auth

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def connect_all(hosts: Sequence[str], opts: SshOptions) -> ConnectResult:
    """Connect to every host at once. Keys of the result are the hostfile entries as given."""
    config = load_config(opts.config_path)
    result = ConnectResult()

    def one(host: str):
        t0 = time.perf_counter()
        try:
            client = connect(resolve(host, opts, config), opts)
            result.connect_ms[host] = (time.perf_counter() - t0) * 1e3
            return host, client, None
        except SshError as exc:
            return host, None, exc

    if not hosts:
        return result
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        for host, client, err in pool.map(one, hosts):
            if err is not None:
                result.errors[host] = err
            else:
                result.clients[host] = client
    return result
