"""One thread count per process (sicl_fast.threads): torch and the C++ ops take the same number, from any thread."""
from __future__ import annotations

import threading

import pytest
import torch

from sicl_fast.errors import SiclError
from sicl_fast.ops import cpp_ops
from sicl_fast.threads import apply_threads, available_cores, resolve_threads

needs_cpp = pytest.mark.skipif(not cpp_ops.available(), reason="the C++ extension sicl_fast._C is not built")


@pytest.fixture
def restore_threads():
    n_torch = torch.get_num_threads()
    n_cpp = cpp_ops.num_threads() if cpp_ops.available() else None
    yield
    torch.set_num_threads(n_torch)
    if n_cpp is not None:
        cpp_ops.set_num_threads(n_cpp)


def test_resolve_defaults_to_the_cores_this_process_may_use():
    assert resolve_threads(None) == available_cores() >= 1
    assert resolve_threads(3) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(SiclError, match="threads must be an integer >= 1"):
            resolve_threads(bad)


@needs_cpp
def test_apply_sets_torch_and_the_cpp_ops(restore_threads):
    for n in (1, 3):
        assert apply_threads(n) == n
        assert torch.get_num_threads() == n and cpp_ops.num_threads() == n


@needs_cpp
def test_cpp_thread_count_holds_in_other_threads(restore_threads):
    """A server runs the engine on a worker thread: the count set on the main thread is the one its ops use
    (OpenMP's own setting is per thread, and a new thread would start from the default)."""
    apply_threads(1)
    seen = []
    t = threading.Thread(target=lambda: seen.append(cpp_ops.num_threads()))
    t.start()
    t.join()
    assert seen == [1]


@needs_cpp
def test_set_num_threads_refuses_zero(restore_threads):
    with pytest.raises(ValueError, match="n must be >= 1"):
        cpp_ops.set_num_threads(0)
