"""Property-based fuzzing, with Hypothesis, of every reader of input a user or another machine
hands us: the hostfile and host-filter parsers, the core list and env-file parsers, the
checkpoint readers (our manifest, DeepSpeed's layout, universal checkpoints, `latest`,
inference descriptors) and the config reader (test_fuzz_config.py).

The property is the same everywhere: an input either loads, or is refused with the project's
one error type for that reader, in one line. No other exception, and no hang: each example runs
under an alarm. The example budget is fixed and the draw derandomized, so CI runs the same
examples every time (no flakes), and a failure prints the example that shrank to it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import string
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dslaunch.launcher.cores import parse_core_list
from dslaunch.launcher.envfile import parse_env_text
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import parse_hostfile_text
from dslaunch.launcher.world import layout_world
from dslaunch.runtime.checkpoint import CheckpointError
import repo_paths

DATA = repo_paths.DATA
OURS = DATA / "ds_interop" / "dslaunch" / "s1_fp32"
THEIRS = DATA / "ds_interop" / "ds" / "s1_fp32"
UNIVERSAL = DATA / "ds_universal" / "ds" / "s2_fp32" / "global_step3_universal"

# one fixed budget for every reader; derandomize: the same examples on every run
FUZZ = settings(max_examples=int(os.environ.get("DSLAUNCH_FUZZ_EXAMPLES", "120")), derandomize=True,
                database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
HANG_SECONDS = 20


class Hung(Exception):
    pass


@contextlib.contextmanager
def no_hang(seconds: float = HANG_SECONDS):
    """Fail the example, rather than the whole run, when a reader blocks."""
    def ring(*_):
        raise Hung(f"the reader ran past {seconds} s on this input")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_line(exc: BaseException) -> None:
    text = str(exc)
    assert text and len(text.splitlines()) == 1 and text.isprintable(), f"not one printable line: {text!r}"


def loads_or_refuses(fn, error, *args, **kwargs):
    """fn(*args) returns, or raises `error` in one line; anything else fails the example."""
    with no_hang():
        try:
            return fn(*args, **kwargs)
        except error as exc:
            one_line(exc)
            return exc


# -- strategies -----------------------------------------------------------------------------
ASCII_LINES = st.text(alphabet=string.printable, max_size=400)
ANY_TEXT = st.text(max_size=300)
HOSTY = st.text(alphabet=string.ascii_letters + string.digits + ".-_@:=, #\t", max_size=40)
DIGITS = st.one_of(st.integers(-10, 10 ** 12).map(str), st.text(alphabet="0123456789-+. x", max_size=12))


@st.composite
def hostfiles(draw):
    """Mostly well-formed lines, each perturbed in one of the ways a hand-edited file is."""
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        host = draw(st.one_of(st.sampled_from(["w0", "w1", "node-2.cluster", "10.0.0.1", "u@w3"]), HOSTY))
        parts = [host]
        for _ in range(draw(st.integers(0, 2))):
            parts.append(draw(st.one_of(DIGITS.map(lambda d: "slots=" + d), HOSTY)))
        sep = draw(st.sampled_from([" ", "\t", "  "]))
        comment = draw(st.one_of(st.just(""), st.just(" # a comment"), ANY_TEXT.map(lambda t: "#" + t)))
        lines.append(sep.join(parts) + comment)
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


def _json(value) -> str:
    return json.dumps(value, allow_nan=True)


# -- launcher readers -------------------------------------------------------------------------
@FUZZ
@given(st.one_of(hostfiles(), ASCII_LINES, ANY_TEXT))
def test_hostfile_text_parses_or_is_refused_in_one_line(text):
    loads_or_refuses(parse_hostfile_text, LaunchConfigError, text, "hosts")


HOSTS = parse_hostfile_text("w0 slots=2\nw1 slots=4\nnode-2 slots=1\n", "hosts")
FILTERS = st.one_of(st.text(alphabet="w01node-2@:, ", max_size=24), ANY_TEXT, st.just(""))


@FUZZ
@given(FILTERS, FILTERS, st.one_of(st.none(), st.integers(-3, 6)), st.one_of(st.none(), st.integers(-3, 6)))
def test_host_filters_and_counts_lay_out_a_world_or_are_refused(include, exclude, nodes, gpus):
    world = loads_or_refuses(layout_world, LaunchConfigError, HOSTS, include=include, exclude=exclude,
                             num_nodes=nodes, num_gpus=gpus)
    if not isinstance(world, Exception):
        assert 0 < world.world_size <= 7


@FUZZ
@given(st.one_of(st.text(alphabet="0123456789-, ", max_size=30), ANY_TEXT,
                 st.lists(st.integers(-5, 10 ** 9), max_size=6).map(lambda xs: ",".join(map(str, xs)))))
@example("\u00b9")  # found by this test: "¹".isdigit() is true and int() refuses it
def test_core_lists_parse_or_are_refused(text):
    cores = loads_or_refuses(parse_core_list, LaunchConfigError, text)
    if isinstance(cores, list):
        assert all(isinstance(c, int) and c >= 0 for c in cores) and len(cores) == len(set(cores))


@FUZZ
@given(st.one_of(ASCII_LINES, ANY_TEXT,
                 st.lists(st.tuples(st.text(alphabet=string.ascii_letters + "_0123456789 =", max_size=12), ANY_TEXT),
                          max_size=5).map(lambda kv: "\n".join(f"{k}={v}" for k, v in kv))))
def test_env_files_parse_or_are_refused(text):
    env = loads_or_refuses(parse_env_text, LaunchConfigError, text, ".dslaunch_env")
    if isinstance(env, dict):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


# -- checkpoint readers ---------------------------------------------------------------------------
def consolidate_outcome(ck: Path, out: Path, capsys) -> str:
    """`dslaunch consolidate CK OUT` through its command: 'ok', or its one refusal line (exit 2)."""
    from dslaunch.runtime.checkpoint.consolidate import consolidate

    with no_hang():
        try:
            consolidate.main(args=[str(ck), str(out)], prog_name="dslaunch consolidate", standalone_mode=True)
        except SystemExit as exc:
            err = capsys.readouterr().err.strip().splitlines()
            if exc.code in (0, None):
                return "ok"
            assert exc.code == 2, (exc.code, err)
            assert len(err) == 1, err
            return err[0]
    return "ok"


@pytest.fixture
def scratch():
    """A fresh folder per example (a pytest tmp_path is shared by all of a test's examples)."""
    def make():
        return Path(tempfile.mkdtemp(prefix="fuzz-"))
    made = []

    def factory():
        d = make()
        made.append(d)
        return d
    yield factory
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


MANIFEST_PATHS = [("tag",), ("world_size",), ("zero_stage",), ("sharded_optimizer_state",), ("files",),
                  ("pickled_client_state",), ("node_local",), ("topology",), ("layers",), ("checksum",), ("format",),
                  ("files", "mp_rank_00_model_states.pt"), ("files", "mp_rank_00_model_states.pt", "size"),
                  ("files", "mp_rank_00_model_states.pt", "digest"), ("files", "../outside.pt"),
                  ("topology", "data"), ("new_key",)]


@FUZZ
@given(st.sampled_from(MANIFEST_PATHS), JSON_VALUES)
@example(path=("topology",), value=None)  # found by this test: a TypeError traceback
def test_a_tampered_manifest_loads_or_is_refused_in_one_line(capsys, scratch, path, value):
    ck = scratch() / "ck"
    shutil.copytree(OURS, ck)
    tag = next(p for p in ck.iterdir() if p.is_dir())
    mpath = tag / "manifest.json"
    manifest = json.loads(mpath.read_text())
    node = manifest
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    mpath.write_text(_json(manifest))
    consolidate_outcome(ck, ck.parent / "out.pt", capsys)


@FUZZ
@given(st.sampled_from(["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
       st.floats(0, 1), st.integers(1, 64), st.integers(0, 255), st.booleans())
# found by this test: one byte of a shard's tensor metadata, then a RuntimeError from the copy
@example(name="zero_pp_rank_0_mp_rank_00_optim_states.pt", where=0.24766823884672512, length=1, byte=1, truncate=False)
def test_damaged_bytes_in_a_deepspeed_shard_are_refused_in_one_line(capsys, scratch, name, where, length, byte,
                                                                     truncate):
    ck = scratch() / "ck"
    shutil.copytree(THEIRS, ck)
    f = ck / "global_step3" / name
    size = f.stat().st_size
    at = min(size - 1, int(where * size))
    with open(f, "r+b") as fh:
        if truncate:
            fh.truncate(at)
        else:
            fh.seek(at)
            fh.write(bytes([byte]) * length)
    consolidate_outcome(ck, ck.parent / "out.pt", capsys)


SHAPES = st.one_of(JSON_VALUES, st.lists(st.integers(-2 ** 40, 2 ** 40), max_size=4),
                   st.lists(st.integers(0, 20), min_size=1, max_size=3))


@FUZZ
@given(SHAPES, st.booleans())
@example(shape=[{"\r": None}], whole_dict=True)  # found by this test: a name with a line break split the line
def test_crafted_param_shapes_are_refused_or_load(capsys, scratch, shape, whole_dict):
    from dslaunch.runtime.checkpoint.files import load_torch
    from dslaunch.runtime.checkpoint.foreign import save_with_deepspeed_globals

    ck = scratch() / "ck"
    shutil.copytree(THEIRS, ck)
    f = ck / "global_step3" / "mp_rank_00_model_states.pt"
    model = load_torch(str(f))
    if whole_dict:
        model["param_shapes"] = shape
    else:
        model["param_shapes"][0]["inp.weight"] = shape
    with open(f, "wb") as fh:
        save_with_deepspeed_globals(model, fh)
    consolidate_outcome(ck, ck.parent / "out.pt", capsys)


@FUZZ
@given(st.one_of(st.binary(max_size=200), ANY_TEXT.map(str.encode), st.just(b"../../etc"),
                 st.sampled_from([b"global_step3", b"global_step3\n", b"/tmp", b"", b"\x00"])))
@example(b"0\xc2\x85!")  # found by this test: U+0085 (next line) inside the quoted tag split the line
def test_any_latest_file_is_followed_only_to_a_tag_inside_the_checkpoint(capsys, scratch, latest):
    ck = scratch() / "ck"
    shutil.copytree(THEIRS, ck)
    (ck / "latest").write_bytes(latest)
    consolidate_outcome(ck, ck.parent / "out.pt", capsys)


TENSORS = st.builds(
    lambda dtype, shape, fill: torch.full(shape, fill).to(dtype),
    st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from([0.0, 1.5, -2.0, float("nan"), float("inf")]))


@FUZZ
@given(st.sampled_from(["inp.weight", "inp.bias", "out.weight"]), st.sampled_from(["fp32", "exp_avg", "exp_avg_sq"]),
       st.one_of(TENSORS, JSON_VALUES, TENSORS.map(lambda t: {"param": t})))
def test_a_crafted_universal_checkpoint_opens_or_is_refused(scratch, pname, key, value):
    from dslaunch.runtime.checkpoint.universal import open_universal

    ck = scratch() / "u"
    shutil.copytree(UNIVERSAL, ck)
    torch.save(value, ck / "zero" / pname / f"{key}.pt")
    uc = loads_or_refuses(open_universal, CheckpointError, str(ck))
    if not isinstance(uc, Exception):
        for entry in uc.params.values():
            assert all(bool(torch.isfinite(t).all()) for k, t in entry.items() if torch.is_tensor(t) and k != "step")


DESCRIPTOR_KEYS = st.sampled_from(["type", "checkpoints", "version", "base_dir", "parallelization", "tp_size",
                                   "mp_size", "weight_map"])
NAMES = st.one_of(st.sampled_from(["m.pt", "../m.pt", "/etc/passwd", "sub/../m.pt", "", ".", "m.pt\x00"]),
                  st.text(max_size=12))
DESCRIPTORS = st.one_of(
    JSON_VALUES,
    st.dictionaries(DESCRIPTOR_KEYS, st.one_of(JSON_VALUES, NAMES, st.lists(NAMES, max_size=3)), max_size=4))


@FUZZ
@given(DESCRIPTORS, st.booleans())
def test_inference_descriptors_name_files_inside_their_folder_or_are_refused(scratch, descriptor, with_base_dir):
    from dslaunch.runtime.strict import ConfigError
    from dslaunch.runtime.inference.loader import checkpoint_files

    root = scratch()
    (root / "m.pt").write_bytes(b"")
    path = root / "ckpt.json"
    path.write_text(_json(descriptor))
    files = loads_or_refuses(checkpoint_files, (CheckpointError, ConfigError), str(path),
                             base_dir=str(root) if with_base_dir else "")
    if isinstance(files, list):
        for f in files:
            assert os.path.realpath(f).startswith(str(root.resolve()) + os.sep), f


# -- the config reader ------------------------------------------------------------------------------
def _config_keys():
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.strict import key_rows

    return sorted(r.key for r in key_rows(DeepSpeedConfig))


CONFIG_KEYS = _config_keys()
NUMBERS = st.one_of(st.integers(-2 ** 65, 2 ** 65), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, 2, 4, 8, -1, 0.5, 1e-3, "0.01", True, False, None, "auto", [0.9, 0.999]]))


@st.composite
def configs(draw):
    """A config built from declared keys (dotted paths nested back into objects), each given a
    number-like, JSON or plausible value: the reader's branches, not just its JSON parser."""
    cfg: dict = {}
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), max_size=8)):
        value = draw(st.one_of(NUMBERS, JSON_VALUES, st.sampled_from(["cpu", "none", "Adam", "WarmupLR", "bf16"])))
        node, *parents = cfg, *key.split(".")[:-1]
        for part in key.split(".")[:-1]:
            nxt = node.get(part) if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[key.split(".")[-1]] = value
    if draw(st.booleans()):
        cfg.setdefault("train_batch_size", draw(st.sampled_from([1, 2, 4, 8, 3])))
    if draw(st.booleans()):
        cfg["optimizer"] = {"type": draw(st.sampled_from(["Adam", "AdamW", "SGD", "Lion", "Adagrad", "Lamb", "adam"])),
                            "params": draw(st.dictionaries(st.sampled_from(["lr", "betas", "eps", "weight_decay",
                                                                            "momentum", "torch_adam", "adam_w_mode"]),
                                                           NUMBERS, max_size=4))}
    return cfg


CONFIG_TEXT = st.one_of(configs().map(_json), JSON_VALUES.map(_json), ASCII_LINES,
                        configs().map(_json).map(lambda t: t[: len(t) // 2]),  # cut short
                        st.builds(lambda a, b: a + b, configs().map(_json), ANY_TEXT))


@FUZZ
@given(CONFIG_TEXT, st.sampled_from([".json", ".yaml"]), st.integers(1, 4))
def test_any_config_file_is_read_or_refused_in_one_line(scratch, text, suffix, dp):
    from dslaunch.runtime.config import DeepSpeedConfig, resolve_batch_sizes
    from dslaunch.runtime.optim import OptimizerTarget, build_optimizer
    from dslaunch.runtime.strict import ConfigError

    path = scratch() / f"ds_config{suffix}"
    path.write_text(text)

    def read():
        cfg = DeepSpeedConfig.load(str(path))
        if cfg.train_batch_size or cfg.train_micro_batch_size_per_gpu or cfg.gradient_accumulation_steps:
            resolve_batch_sizes(cfg, dp)
        if cfg.optimizer is not None:
            build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))], OptimizerTarget())
        return cfg

    loads_or_refuses(read, ConfigError)
