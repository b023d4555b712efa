"""Every launch configuration the launchers choose on a GPU compiles for sm_90 at the real shapes of every family the
fast backend runs, without a GPU (kernels/_configs.py: each kernel's configuration function called as its launcher
calls it, compiled by Triton's own ptxas): shared memory within an H100 / H200 block (232,448 B) and an A100's
(166,912 B), no register spill, every block a power of two. The interpreter that runs the other kernel tests has no
shared memory or register file and runs ranges the GPU compile refuses: a float32 head-256 prefix_attention needed
344,320 B, rope_rows chose 5 rows a program at 3 / 1 heads of 24.

The compiles are cached by the kernels' sources, the configuration and Triton's version (kernels/_configs.cache_dir):
a run from nothing compiles about 97 launch decisions (the float32 attention's at both precisions among them) in a
child interpreter, a later one reads them. The full sweep (every family, length, dtype and flag set, and sm_80):
`python bench/gpu_kernels.py --compile-only`."""
import json

import pytest

from test_ops import why_unavailable

pytestmark = pytest.mark.skipif(bool(why_unavailable("triton")), reason="needs triton")


@pytest.fixture(scope="module")
def configs():
    pytest.importorskip("triton.backends.nvidia")
    from sicl_fast.kernels import _configs

    return _configs


@pytest.fixture(scope="module")
def compiled(configs):
    """{case: result} of the suite's launch decisions compiled for sm_90 (through the cache)."""
    return configs.compile_cases(configs.suite_cases(), 90)


def test_the_table_has_every_family_the_fast_backend_runs(configs):
    """FAMILIES is the one table of shapes: a family added to the fast backend adds its entry (family_cases refuses a
    field it does not read, so an entry cannot ask for a flag the cases ignore)."""
    from sicl_fast.models.decoder_config import SUPPORTED_FAMILIES

    assert set(SUPPORTED_FAMILIES) <= {f["model_type"] for f in configs.FAMILIES.values()}
    with pytest.raises(ValueError, match="fields \\['partial_rotary'\\]"):
        configs.FAMILIES["odd"] = dict(configs.FAMILIES["tests"], partial_rotary=0.5)
        try:
            configs.family_cases("odd")
        finally:
            del configs.FAMILIES["odd"]


def test_every_launch_decision_compiles_for_sm90_within_the_gpu(configs, compiled):
    """Each launcher's own configuration at each family's shapes: compiled, within an A100's and an H100's shared
    memory, no spill, powers of two (kernels/_configs.problems); the attention kernels of every head size in both
    dtypes among them."""
    problems = [p for case, result in compiled.items() for p in configs.problems(case, result, 90)]
    assert not problems, "\n".join(problems)
    heads = {(c.signature[0][1], dict(c.constexprs)["BLOCK_D"]) for c in compiled if c.spec == "attention"
             and c.aligned}
    assert heads == {(dt, hd) for dt in ("*fp32", "*bf16") for hd in (64, 128, 256)}
    assert {c.spec for c in compiled} == set(configs._aot.SPECS) - {"lse_partial_f32"}  # every kernel


def fma_share(case, result) -> float:
    """The share of an attention decision's products taken by FMA on the CUDA cores: the compile's static FMA count
    a thread (both key loops: the prefix's and the row's own) x its threads, over the multiply-adds of one block of
    each loop (q k^T and p v: 2 x BLOCK_M x BLOCK_N x BLOCK_D each). About 1 for IEEE products; the softmax's own
    FMAs where the products run on the tensor cores."""
    consts, opts = dict(case.constexprs), dict(case.options)
    products = 2 * 2 * consts["BLOCK_M"] * consts["BLOCK_N"] * consts["BLOCK_D"]
    return result["float_ops"].get("fma.rn.f32", 0) * 32 * opts["num_warps"] / products


def test_the_float32_attention_runs_on_the_tensor_cores(configs, compiled):
    """Issue 53, item 6: both attention kernels' float32 launch decisions at tf32x3 (the default) compile to
    tensor-core instructions on tf32 operands (mma.sync or wgmma.mma_async: kernels/_aot.tensor_core_ops), their FMAs
    a few per cent of the products (the softmax's); at 'ieee' (asked for) to IEEE FMA on the CUDA cores for every
    product and no tensor-core instruction; the bf16 prefix attention's on bf16 operands."""
    seen = set()
    for case, result in compiled.items():
        if case.spec not in ("attention", "attention_rows"):
            continue
        consts, tensor = dict(case.constexprs), result["tensor_ops"]
        if dict(case.signature).get("q_ptr") == "*bf16":
            assert any(op.endswith(" bf16") for op in tensor), (case.what, tensor)
            continue
        seen.add((case.spec, consts["BLOCK_D"], consts["PRECISION"]))
        if consts["PRECISION"] == "ieee":
            assert not tensor and fma_share(case, result) > 0.9, (case.what, tensor, fma_share(case, result))
        else:
            assert tensor and all(op.startswith(("mma.sync m16n8k8 ", "wgmma.mma_async m64n")) and op.endswith(" tf32")
                                  for op in tensor), (case.what, tensor)
            assert fma_share(case, result) < 0.1, (case.what, fma_share(case, result))
    assert seen == {(spec, hd, p) for spec in ("attention", "attention_rows") for hd in (32, 64, 128, 256)
                    for p in ("tf32x3", "ieee")}


def test_a_problem_is_named(configs):
    """What problems() says of a compile that fails, one over the shared memory of a block, and a spill."""
    case = configs.Case("rope_rows", "tests: rope_rows_config(...)", constexprs=(("BLOCK_R", 5),))
    assert configs.problems(case, {"error": "CompilationError: arange's range must be a power of 2"}) == [
        "tests: rope_rows_config(...): rope_rows does not compile for sm_90: CompilationError: arange's range must be "
        "a power of 2"]
    big = configs.problems(case, {"shared": 344_320, "regs": 255, "stack": 24, "error": None})
    assert big == ["tests: rope_rows_config(...): rope_rows needs 344,320 B of shared memory, over sm_90's 232,448 B",
                   "tests: rope_rows_config(...): rope_rows needs 344,320 B of shared memory, over sm_80's 166,912 B",
                   "tests: rope_rows_config(...): rope_rows spills (24 B stack frame, 255 registers)",
                   "tests: rope_rows_config(...): rope_rows has blocks that are not powers of two: BLOCK_R=5"]


def test_a_damaged_cache_entry_is_compiled_again_not_a_traceback(configs, tmp_path, monkeypatch):
    # issue 54 item 4: an entry cut short or edited was json.loads' raw exception (or a KeyError) in every later check
    cases = configs.suite_cases()[:4]
    good = {"shared": 1024, "regs": 32, "stack": 0, "error": None}
    damaged = [b"", b'{"shared": 10', b"[1, 2]", b'{"error": null, "shared": "1"}']
    for case, data in zip(cases, damaged):
        (tmp_path / f"{case.key(90)}.json").write_bytes(data)
    compiled = []

    def compile_missing(todo, arch, cache, jobs, timeout):
        compiled.extend(todo)
        for case in todo:
            (cache / f"{case.key(arch)}.json").write_text(json.dumps(good))

    monkeypatch.setattr(configs, "_compile_missing", compile_missing)
    assert configs.compile_cases(cases, 90, cache=tmp_path) == {case: good for case in cases}
    assert compiled == cases
    assert configs.compile_cases(cases, 90, cache=tmp_path) == {case: good for case in cases} and len(compiled) == 4
