"""Hostfile grammar: a table of accepted files and a table of rejected ones with their messages."""
import pytest

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import HostSpec, parse_hostfile, parse_hostfile_text
import repo_paths


@pytest.mark.parametrize(
    "text, expected",
    [
        ("w0 slots=4\n", [("w0", None, 4, "hf:1")]),
        ("w0 slots=4\nw1 slots=2", [("w0", None, 4, "hf:1"), ("w1", None, 2, "hf:2")]),
        ("# cluster\n\n  w0   slots=1   # trailing\n", [("w0", None, 1, "hf:3")]),
        ("alice@w0 slots=8\n", [("w0", "alice", 8, "hf:1")]),
        ("10.0.0.5 slots=2\n\t\nw-1.example.com slots=3\n", [("10.0.0.5", None, 2, "hf:1"), ("w-1.example.com", None, 3, "hf:3")]),
        ("localhost slots=2 #x slots=9\n", [("localhost", None, 2, "hf:1")]),
        ("w0 slots=16\r\nw1 slots=1\r\n", [("w0", None, 16, "hf:1"), ("w1", None, 1, "hf:2")]),
    ],
)
def test_accepted(text, expected):
    assert parse_hostfile_text(text, "hf") == [HostSpec(*e) for e in expected]


@pytest.mark.parametrize(
    "text, message",
    [
        ("w0\n", "hf:1: host 'w0' has no slots=N"),
        ("w0 slots=0\n", "hf:1: slots=0: a host needs at least 1 slot"),
        ("w0 slots=4x\n", "hf:1: slots=4x is not a whole number"),
        ("w0 slots=-1\n", "hf:1: slots=-1 is not a whole number"),
        ("w0 slots=\n", "hf:1: slots= is not a whole number"),
        ("w0 slots=٣\n", "hf:1: slots=٣ is not a whole number"),
        ("w0 slots=2\n# c\nw0 slots=2\n", "hf:3: duplicate host 'w0' (first listed at hf:1)"),
        ("w0 slots=2\nbob@w0 slots=2\n", "hf:2: duplicate host 'w0' (first listed at hf:1)"),
        ("", "hf: hostfile lists no hosts"),
        ("# only comments\n\n   \n", "hf: hostfile lists no hosts"),
        ("w0 max_slots=2\n", "hf:1: unknown key 'max_slots' (only slots=N is allowed)"),
        ("w0 slots=2 slots=3\n", "hf:1: slots given twice for host 'w0'"),
        ("w0 4\n", "hf:1: expected 'slots=N' after the host, got '4'"),
        ("w0:1 slots=2\n", "hf:1: invalid host name 'w0:1'"),
        ("@w0 slots=2\n", "hf:1: invalid user@host '@w0'"),
        ("a@b@c slots=2\n", "hf:1: invalid user@host 'a@b@c'"),
        ("w0 slots=1\nw1 slots=1 gpus=2\n", "hf:2: unknown key 'gpus' (only slots=N is allowed)"),
    ],
)
def test_rejected(text, message):
    with pytest.raises(LaunchConfigError) as err:
        parse_hostfile_text(text, "hf")
    assert str(err.value) == message


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(LaunchConfigError, match=r"nope: hostfile not found"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(LaunchConfigError, match=r"hostfile is a directory"):
        parse_hostfile(tmp_path)
    bad = tmp_path / "bin"
    bad.write_bytes(b"w0 slots=1\n\xff\xfe\n")
    with pytest.raises(LaunchConfigError, match=r"bin: hostfile is not UTF-8"):
        parse_hostfile(bad)
    good = tmp_path / "hosts"
    good.write_text("w0 slots=2\n")
    assert parse_hostfile(good) == [HostSpec("w0", None, 2, f"{good}:1")]


def test_example_hostfiles_parse():
    from pathlib import Path

    examples = sorted((repo_paths.ROOT / "hostfiles").glob("*"))
    assert examples, "hostfiles/ holds example hostfiles"
    for path in examples:
        assert parse_hostfile(path), path
    assert HostSpec("w0", "bob", 1, "x:1").ssh_target == "bob@w0"
