"""The `slow` marker: conftest.py puts it on every test that starts processes, read from the
test's code by process_marks.py, and on no other (`-m "not slow"` must still run every
in-process test)."""
import functools
import subprocess
import sys

from dslaunch.kernels import builder

from dist_harness import run_function
from process_marks import Finder


def _pure(x):
    return x + 1


def _starts_a_child():
    return subprocess.run([sys.executable, "-c", "pass"], check=True).returncode


def _through_a_helper():
    return _pure(_starts_a_child())


@functools.lru_cache(maxsize=None)
def _cached_ranks():
    return run_function(_pure, nprocs=1, kwargs={"x": 1}, init_process_group=False)


def _local_import():
    import os

    return os.fork


def _uses_a_cached_helper():
    return _cached_ranks()


def _compiles(spec):
    return builder.build(spec)  # a compiler, through the kernels' one way to build an op


def test_the_finder_follows_helpers_wrappers_and_local_imports():
    finder = Finder()
    assert not finder.starts_processes(_pure)
    assert finder.starts_processes(_starts_a_child)
    assert finder.starts_processes(_through_a_helper)  # a helper of this module
    assert finder.starts_processes(_uses_a_cached_helper)  # through functools' wrapper, into dist_harness
    assert finder.starts_processes(_local_import)  # os.fork named in the function
    assert finder.starts_processes(_compiles)  # module.function


def test_a_test_that_starts_a_process_is_marked_slow(request):
    assert request.node.get_closest_marker("slow") is not None
    assert _starts_a_child() == 0


def test_an_in_process_test_is_not_marked(request):
    assert request.node.get_closest_marker("slow") is None
    assert _pure(1) == 2
