"""Benchmark options: `--impl` names the implementation of the hot ops for a whole run (sicl_fast.ops)."""
import pytest

from sicl_fast.ops import IMPLS


def pytest_addoption(parser):
    parser.addoption("--impl", default="auto", choices=IMPLS,
                     help="implementation of the hot ops the step benchmarks use (default: auto)")


@pytest.fixture(scope="session")
def impl(request):
    return request.config.getoption("--impl")
