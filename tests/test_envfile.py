"""`.dslaunch_env` grammar and lookup order."""
import pytest

from dslaunch.launcher.envfile import load_env_file, parse_env_text
from dslaunch.launcher.errors import LaunchConfigError


def test_grammar():
    text = "# c\n\nA=1\nexport B = two words \nC='q $HOME'\nD=\"x=y\"\nE=\nF=#not-a-comment\n"
    assert parse_env_text(text, "f") == {"A": "1", "B": "two words", "C": "q $HOME", "D": "x=y", "E": "", "F": "#not-a-comment"}


@pytest.mark.parametrize(
    "text, message",
    [("A=1\nNOEQUALS\n", "f:2: expected KEY=VALUE, got 'NOEQUALS'"), ("1A=x\n", "f:1: '1A' is not a valid variable name"),
     ("A B=x\n", "f:1: 'A B' is not a valid variable name")],
)
def test_errors(text, message):
    with pytest.raises(LaunchConfigError) as err:
        parse_env_text(text, "f")
    assert str(err.value) == message


def test_lookup_order(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    assert load_env_file(None, cwd, home).path is None
    (home / ".dslaunch_env").write_text("A=home\n")
    assert load_env_file(None, cwd, home).values == {"A": "home"}
    (cwd / ".dslaunch_env").write_text("A=cwd\n")
    assert load_env_file(None, cwd, home).values == {"A": "cwd"}
    explicit = tmp_path / "e"
    explicit.write_text("A=explicit\n")
    assert load_env_file(str(explicit), cwd, home).values == {"A": "explicit"}
    with pytest.raises(LaunchConfigError, match="missing: env file .* not found"):
        load_env_file(str(tmp_path / "missing"), cwd, home)
