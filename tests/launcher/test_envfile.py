"""Env files: grammar, which files are read and in what precedence (.deepspeed_env too),
the launch notice that names them, and their values masked by origin."""
import pytest

from dslaunch.launcher.envfile import load_env_files, parse_env_text
from dslaunch.launcher.errors import LaunchConfigError


def test_grammar():
    text = "# c\n\nA=1\nexport B = two words \nC='q $HOME'\nD=\"x=y\"\nE=\nF=#not-a-comment\n"
    assert parse_env_text(text, "f") == {"A": "1", "B": "two words", "C": "q $HOME", "D": "x=y", "E": "", "F": "#not-a-comment"}


@pytest.mark.parametrize(
    "text, message",
    [("A=1\nNOEQUALS\n", "f:2: expected KEY=VALUE, got 'NOEQUALS'"), ("1A=x\n", "f:1: '1A' is not a valid variable name"),
     ("A B=x\n", "f:1: 'A B' is not a valid variable name"),
     ("A=1\nB=x\0y\n", "f:2: contains a NUL byte, which no environment variable can hold")],
)
def test_errors(text, message):
    with pytest.raises(LaunchConfigError) as err:
        parse_env_text(text, "f")
    assert str(err.value) == message


def test_precedence_home_then_cwd_deepspeed_then_dslaunch(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    assert load_env_files(None, cwd, home, {}).files == ()
    (home / ".deepspeed_env").write_text("A=home-ds\nB=home-ds\nC=home-ds\nD=home-ds\n")
    (home / ".dslaunch_env").write_text("B=home\nC=home\nD=home\n")
    (cwd / ".deepspeed_env").write_text("C=cwd-ds\nD=cwd-ds\n")
    (cwd / ".dslaunch_env").write_text("D=cwd\n")
    files = load_env_files(None, cwd, home, {})
    assert files.values == {"A": "home-ds", "B": "home", "C": "cwd-ds", "D": "cwd"}
    assert files.paths == [str(home / ".deepspeed_env"), str(home / ".dslaunch_env"),
                           str(cwd / ".deepspeed_env"), str(cwd / ".dslaunch_env")]
    assert files.notices()[2] == f"env file {cwd / '.deepspeed_env'} sets C, D for every worker"
    # DeepSpeed's DS_ENV_FILE renames .deepspeed_env
    (cwd / "custom_env").write_text("E=custom\n")
    assert load_env_files(None, cwd, home, {"DS_ENV_FILE": "custom_env"}).values["E"] == "custom"
    # --env_file replaces the search
    explicit = tmp_path / "e"
    explicit.write_text("A=explicit\n")
    assert load_env_files(str(explicit), cwd, home, {}).values == {"A": "explicit"}
    with pytest.raises(LaunchConfigError, match="missing: env file .* not found"):
        load_env_files(str(tmp_path / "missing"), cwd, home, {})


def test_cwd_that_is_home_reads_each_file_once(tmp_path):
    (tmp_path / ".dslaunch_env").write_text("A=1\n")
    assert load_env_files(None, tmp_path, tmp_path, {}).paths == [str(tmp_path / ".dslaunch_env")]
