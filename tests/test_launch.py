"""The one launch helper of the Triton launchers (kernels/_utils.py: launch, num_warps_for): every launcher goes
through it, the warps follow the block size, and CUDA launches run on their tensors' device."""
import re
from pathlib import Path

import pytest
import torch

from test_ops import why_unavailable

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


@pytest.fixture(scope="module")
def utils():
    if why_unavailable("triton"):
        pytest.skip(why_unavailable("triton"))
    from sicl_fast.kernels import _utils

    return _utils


def test_num_warps_follow_the_block(utils):
    got = {b: utils.num_warps_for(b) for b in (1, 64, 1024, 2048, 4096, 8192, 16384, 32768, 65536)}
    assert got == {1: 4, 64: 4, 1024: 4, 2048: 8, 4096: 8, 8192: 16, 16384: 16, 32768: 32, 65536: 32}


def test_every_launcher_launches_through_the_helper():
    """No `kernel[grid](...)` outside the helper: each launch names its device and its configuration (the dict of
    the kernel's configuration function, _utils.launch_config, or a block)."""
    direct, launches = [], 0
    for f in sorted(KERNELS.glob("*.py")):
        if f.name in ("_utils.py", "_aot.py"):
            continue
        src = f.read_text()
        direct += [f"{f.name}: {m.group(0)}" for m in re.finditer(r"\b_\w+_kernel\[[^\]]", src)]
        for call in re.findall(r"\blaunch\((.*?)\)\n", src, re.S):
            launches += 1
            assert "device=" in call and ("**" in call or "block=" in call), (f.name, call)
    assert direct == [] and launches >= 19


class Recorder:
    """Stands in for a jit kernel: records the grid, the keywords and the current CUDA device of a launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            dev = torch.cuda.current_device() if torch.cuda.is_available() else None
            self.calls.append((grid, kw, dev))
        return run


def test_launch_sets_the_warps_and_passes_the_rest(utils):
    k = Recorder()
    utils.launch(k, (3,), 1, 2, device=torch.device("cpu"), block=2048, BLOCK=2048)
    utils.launch(k, (1,), device=torch.device("cpu"))
    utils.launch(k, (2, 2), device=torch.device("cpu"), block=65536, num_warps=2)  # a tiled kernel's own warps
    assert [(g, kw["num_warps"]) for g, kw, _ in k.calls] == [((3,), 8), ((1,), 4), ((2, 2), 2)]
    assert k.calls[0][1]["BLOCK"] == 2048


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_launch_runs_on_the_tensors_device(utils):
    k = Recorder()
    with torch.cuda.device(0):
        utils.launch(k, (1,), device=torch.device("cuda", 1), block=1024)
        assert torch.cuda.current_device() == 0  # restored after the launch
    assert k.calls[0][2] == 1
