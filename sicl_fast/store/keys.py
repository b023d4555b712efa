"""Store keys: what a calibration's result depends on, hashed.

    key = sha256(fingerprint of the engine, token ids of rows [0, n), token spans, first demonstration row,
                 every CalibrationConfig field (scale resolved), scope)

The engine's fingerprint (`engine_fingerprint`, computed once per engine) holds a digest of the model's weights and
config (not its name: the same files loaded by name, by path or through a link are one model), a digest of the
tokenizer, the run plan's axes that may change the bits of a calibration
(RunPlan.result_axes: the backend, the implementation of the hot ops, the attention kernel that runs, the
difference products, the model's dtype, the device type and, on the CPU, the thread count), and the platform the
kernels were chosen for (`platform`: torch's version, and the CPU's vector capability or the GPU's name), so that
processes sharing a store directory share only what each would have computed itself. The plan's other axes are
left out there, each with its reason (the loop, CUDA graphs and the packing are tested equal bit for bit).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from ..models.facts import weights_digest

# 2: the run plan's result axes (the attention kernel added); 3: the CPU thread count and platform; 4: the model's
# name left out (its weights' digest is what identifies it: one model loaded by name and by path shares its entries)
KEY_FORMAT = 4


def _blake(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=20)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """A digest of the tokenizer: its whole serialised form where it has one (fast tokenizers), else its
    vocabulary, else its type."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        text = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        text = json.dumps(sorted(tokenizer.get_vocab().items()))
    else:
        text = type(tokenizer).__qualname__
    return _blake(text.encode())


def platform(device: torch.device) -> dict:
    """What beside the run plan picks the kernels a calibration runs: torch's version (its products and their
    blocking), and ATen's CPU capability (AVX512, AVX2, ...: the vector paths of torch and of our C++ ops) or the
    GPU's name (its architecture's kernels)."""
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else
             torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else device.type)
    return {"torch": torch.__version__, "hardware": where}


def engine_fingerprint(engine) -> dict:
    """What of the engine changes a calibration's bits (module docstring); JSON-ready."""
    lm, backend = engine.lm, engine.backend
    return {"weights": weights_digest(lm), "tokenizer": tokenizer_digest(lm.tokenizer),
            **backend.plan.result_axes(backend.attention_kernel), "platform": platform(torch.device(lm.device))}


def calibration_key(fingerprint: dict, prompt, config, n: int, scope: str) -> str:
    """The key of the calibration of rows [0, n) of `prompt` with `config` (its scale resolved)."""
    body = {"format": KEY_FORMAT, "engine": fingerprint, "scope": scope,
            "ids": prompt.input_ids[:n].tolist(), "spans": [list(s) for s in prompt.token_spans],
            "demo_start": prompt.demo_start, "config": dataclasses.asdict(config)}
    return _blake(json.dumps(body, sort_keys=True).encode())


__all__ = ["weights_digest", "tokenizer_digest", "engine_fingerprint", "calibration_key", "KEY_FORMAT"]
