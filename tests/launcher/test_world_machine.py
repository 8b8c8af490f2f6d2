"""GPU detection without torch, and plans for machines we do not have (GPU boxes)."""
import io
from pathlib import Path

import pytest

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.machine import MachineFacts, detect_gpus, is_local
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.output import JobOutput, OutputLine
from dslaunch.launcher.plan import build_plan
from dslaunch.launcher.plan_view import plan_to_dict

SCRIPT = str(Path(__file__).resolve())


@pytest.fixture
def driver(tmp_path):
    d = tmp_path / "gpus"
    d.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"):
        (d / bus).mkdir()
    return str(d)


@pytest.mark.parametrize(
    "cvd, expected",
    [(None, (4, None)), ("2,3", (2, ["2", "3"])), ("", (0, [])), ("GPU-aa, GPU-bb", (2, ["GPU-aa", "GPU-bb"])),
     ("1,-1,2", (1, ["1"]))],
)
def test_detect_gpus_from_driver_and_visible_devices(driver, cvd, expected):
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    assert detect_gpus(env, driver_dir=driver, dev_dir="/nonexistent") == expected


def test_no_driver_means_no_gpu_whatever_cuda_visible_devices_says(tmp_path):
    assert detect_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, driver_dir=str(tmp_path / "none"), dev_dir=str(tmp_path)) == (0, None)
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    (tmp_path / "nvidiactl").touch()
    assert detect_gpus({}, driver_dir=str(tmp_path / "none"), dev_dir=str(tmp_path)) == (2, None)


def facts(gpus, visible=None, tmp=None):
    return MachineFacts(gpus, visible, 16, ("localhost", "box"), python="py", cwd=str(Path(SCRIPT).parent),
                        home=str(tmp or "/nonexistent-home"))


def test_gpu_box_plan_maps_slots_through_inherited_visible_devices():
    p = build_plan(LaunchOptions(SCRIPT, num_gpus=2), facts(4, ["4", "5", "6", "7"]), environ={})
    d = plan_to_dict(p)
    assert not p.notes and d["nodes"][0]["accelerator"] == "cuda"
    envs = [w["env"] for w in d["nodes"][0]["workers"]]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "4,5"]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["8", "8"]
    assert "OMP_NUM_THREADS" not in plan_to_dict(build_plan(LaunchOptions(SCRIPT), facts(4), {"OMP_NUM_THREADS": "2"}))["nodes"][0]["workers"][0]["env"]
    assert build_plan(LaunchOptions(SCRIPT), facts(4), {}).world.world_size == 4  # default: every GPU


def test_gpu_box_refuses_more_workers_than_gpus(tmp_path):
    with pytest.raises(LaunchConfigError, match="--num_gpus 3: only 2 GPU"):
        build_plan(LaunchOptions(SCRIPT, num_gpus=3), facts(2), {})
    hf = tmp_path / "hf"
    hf.write_text("box slots=4\n")
    with pytest.raises(LaunchConfigError, match=r"hf:1: box would use GPU slot 3 but this machine has 2 GPU"):
        build_plan(LaunchOptions(SCRIPT, hostfile=str(hf)), facts(2), {})


def test_is_local():
    assert is_local("localhost", ["localhost"]) and is_local("127.0.1.1", []) and not is_local("w1", ["localhost"])


class FakeTty(io.BytesIO):
    def isatty(self):
        return True


def test_console_colours_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    tty, pipe = FakeTty(), io.BytesIO()
    out = JobOutput(tty, pipe)
    out.line(OutputLine(1, "rank 1", "stdout", b"hi\n"))
    out.line(OutputLine(1, "rank 1", "stderr", b"oops\n"))
    out.close()
    assert tty.getvalue() == b"\x1b[33m[rank 1]\x1b[0m hi\n" and pipe.getvalue() == b"[rank 1] oops\n"
    monkeypatch.setenv("NO_COLOR", "1")
    plain = FakeTty()
    out = JobOutput(plain, pipe)
    out.line(OutputLine(0, "rank 0", "stdout", b"hi\n"))
    out.close()
    assert plain.getvalue() == b"[rank 0] hi\n"


def test_env_file_values_reach_workers_but_never_override_the_contract(tmp_path):
    (tmp_path / ".dslaunch_env").write_text("OMP_NUM_THREADS=3\nRANK=99\nNCCL_DEBUG=INFO\n")
    p = build_plan(LaunchOptions(SCRIPT, num_gpus=2), facts(0, tmp=tmp_path), {})
    envs = [w.env for w in p.nodes[0].workers]
    assert [(e["OMP_NUM_THREADS"], e["RANK"], e["NCCL_DEBUG"]) for e in envs] == [("3", "0", "INFO"), ("3", "1", "INFO")]
    # every value from an env file is masked in the plan's printed forms, by origin
    shown = plan_to_dict(p)["nodes"][0]["workers"][0]["env"]
    assert (shown["OMP_NUM_THREADS"], shown["NCCL_DEBUG"], shown["RANK"]) == ("***", "***", "0")
    assert p.notes == ["no GPU on this machine: --num_gpus counts worker processes; running 2 on the CPU"]


def test_hidden_gpus_mean_cpu_mode_and_stay_hidden():
    """CUDA_VISIBLE_DEVICES= on a GPU machine: workers on the CPU, and they keep the empty mask."""
    p = build_plan(LaunchOptions(SCRIPT, num_gpus=2), facts(0, []), environ={"CUDA_VISIBLE_DEVICES": ""})
    assert [w.env["DSLAUNCH_ACCELERATOR"] for w in p.nodes[0].workers] == ["cpu", "cpu"]
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in p.nodes[0].workers)
