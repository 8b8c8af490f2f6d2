"""The paramiko transport: config resolution (pure) and host-key policy against real sshd."""
import re
import subprocess
import time

import paramiko

from dslaunch.launcher.options import SshOptions
from dslaunch.launcher.ssh import connect_all, resolve

CONFIG = """
Host n1
    HostName 10.9.9.1
    User carol
    Port 2222
    IdentityFile ~/keys/n1
    UserKnownHostsFile ~/kh/n1
Host *
    User dave
"""


def _cfg():
    return paramiko.SSHConfig.from_text(CONFIG)


def test_resolve_precedence_command_line_then_hostfile_then_config():
    t = resolve("n1", SshOptions(), _cfg())
    assert (t.alias, t.hostname, t.user, t.port) == ("n1", "10.9.9.1", "carol", 2222)
    assert t.key_files[0].endswith("/keys/n1") and t.known_hosts_files[0].endswith("/kh/n1")
    assert resolve("bob@n1", SshOptions(), _cfg()).user == "bob"
    t = resolve("bob@n1", SshOptions(user="erin", port=22, key="/k"), _cfg())
    assert (t.user, t.port, t.key_files) == ("erin", 22, ("/k",))
    other = resolve("n2", SshOptions(), _cfg())
    assert (other.hostname, other.user, other.port) == ("n2", "dave", 22)
    assert other.known_hosts_files[0].endswith("/.ssh/known_hosts")


def test_connect_all_is_parallel_and_names_hosts(ns_cluster, ssh_home, monkeypatch):
    env, home = ssh_home
    monkeypatch.setenv("HOME", str(home))
    dead = [ns_cluster.unused_ip, f"{ns_cluster.subnet}.98", f"{ns_cluster.subnet}.97"]
    t0 = time.monotonic()
    res = connect_all([h.name for h in ns_cluster.hosts] + dead, SshOptions(timeout=1.5))
    took = time.monotonic() - t0
    try:
        assert sorted(res.clients) == [h.name for h in ns_cluster.hosts]
        for name, client in res.clients.items():
            _, out, _ = client.exec_command("hostname")
            assert out.read().decode().strip() == name  # the config's HostName mapping was used
        assert sorted(res.errors) == sorted(dead)
        for host in dead:
            # a timeout, or at once "no route" where the kernel still remembers a failed ARP for
            # that address from an earlier test (the neighbour table is per namespace, not per test)
            assert re.match(rf"{re.escape(host)}: (connect to {re.escape(host)}:22 timed out after 1.5s|"
                            rf"cannot connect to {re.escape(host)}:22: No route to host)", str(res.errors[host]))
        assert took < 2 * 1.5, took  # three dead hosts time out side by side, not one after the other (4.5 s)
    finally:
        res.close()


def test_unknown_key_refused_then_accepted_with_flag_and_mismatch_always_refused(ns_cluster, ssh_home, monkeypatch):
    env, home = ssh_home
    monkeypatch.setenv("HOME", str(home))
    kh = home / ".ssh" / "known_hosts"
    host = ns_cluster.hosts[1]
    kh.write_text("")
    res = connect_all([host.ip], SshOptions(timeout=5))
    assert not res.clients
    msg = str(res.errors[host.ip])
    assert msg.startswith(f"{host.ip}: host key ssh-ed25519 ") and "--accept_new_host_keys" in msg
    res = connect_all([host.ip], SshOptions(timeout=5, accept_new_host_keys=True))
    assert list(res.clients) == [host.ip]
    res.close()
    assert host.ip in kh.read_text()
    again = connect_all([host.ip], SshOptions(timeout=5))
    again.close()
    assert not again.errors  # recorded, so trusted now
    # a different key under the same name: refused even with the accept flag
    other = home / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kh.write_text(f"{host.ip} {' '.join(other.with_suffix('.pub').read_text().split()[:2])}\n")
    res = connect_all([host.ip], SshOptions(timeout=5, accept_new_host_keys=True))
    assert "HOST KEY MISMATCH" in str(res.errors[host.ip])
