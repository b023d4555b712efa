"""Engine: one loaded model + one backend; requests in, proxies / calibrations / answers out.

    eng = Engine()                                  # embedded SmolLM2-135M, backend 'auto'
    prompt = eng.prepare({"id": "q1", "demos": [...], "query": "..."})
    res = eng.calibrate(prompt, max_steps=20)       # CalibrationResult
    eng.generate(prompt, res.embeddings).answer     # greedy answer from the calibrated embeddings
"""
from __future__ import annotations

from typing import Any

import torch

from .ascent import CalibrationConfig, CalibrationResult, Calibrator
from .backends import make_backend
from .checks import check_embeddings, check_prompt
from .generate import Generation
from .models import LoadedModel, load
from .proxy import ProxyOut
from .requests import Request, parse_request
from .spans import Prompt, tokenize


class Engine:
    """lm: a LoadedModel (or None to load `model` with `dtype` / `device`)."""

    def __init__(
        self,
        lm: LoadedModel | None = None,
        backend: str = "auto",
        add_special_tokens: bool = False,
        model: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        diff_matmul: str = "auto",
    ) -> None:
        self.lm = lm if lm is not None else load(model, dtype=dtype, device=device)
        self.backend = make_backend(backend, self.lm, diff_matmul=diff_matmul)
        self.add_special_tokens = add_special_tokens

    def prepare(self, request: Request | dict[str, Any], reserve: int = 0) -> Prompt:
        """Tokenize a request (either JSON form or a Request); `reserve` tokens must fit after it."""
        if not isinstance(request, Request):
            request = parse_request(request)
        return tokenize(request, self.lm.tokenizer, self.add_special_tokens, self.lm.max_context, reserve)

    def config(self, config: CalibrationConfig | None = None, **overrides) -> CalibrationConfig:
        """The model's preset (or `config`) with overrides; None values are ignored."""
        if config is None:
            return CalibrationConfig.for_model(self.lm, **overrides)
        return config.replace(**{k: v for k, v in overrides.items() if v is not None})

    def proxy(self, prompt: Prompt, config: CalibrationConfig | None = None, embeds: torch.Tensor | None = None) -> ProxyOut:
        """f(X) and its parts for the prompt's own embeddings (or `embeds` [L, d])."""
        cal = Calibrator(self.backend, self.config(config))
        X = self.backend.embed(check_prompt(prompt)) if embeds is None else check_embeddings(embeds, prompt, self.lm)
        return cal.proxy_of(X.unsqueeze(0), prompt)

    def calibrate(self, prompt: Prompt, config: CalibrationConfig | None = None, on_step=None, **overrides) -> CalibrationResult:
        return Calibrator(self.backend, self.config(config, **overrides)).run(check_prompt(prompt), on_step=on_step)

    def generate(
        self,
        prompt: Prompt,
        embeds: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        stop_strings=("\n",),
        stop_fn=None,
    ) -> Generation:
        """Greedy answer from `embeds` [L, d] (default: the prompt's own embeddings)."""
        X = self.backend.embed(check_prompt(prompt)) if embeds is None else check_embeddings(embeds, prompt, self.lm)
        return self.backend.generate(X, prompt, max_new_tokens, stop_strings=stop_strings, stop_fn=stop_fn)
