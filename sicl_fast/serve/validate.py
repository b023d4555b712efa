"""Bodies -> engine calls, with the server's caps. Runs before a request is queued, so bad input costs no wait.

Every error is a SiclError whose message names the request id and the field, as the CLI's do.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..calibration.ascent import CalibrationConfig
from ..errors import LimitError, RequestError, SiclError
from ..backends.generate import check_stops
from ..formats.requests import check_text
from ..formats.spans import Prompt
from .schema import CalibrateBody, ProxyBody
from .settings import ServeSettings


DEFAULT_NEW_TOKENS = 32  # /v1/calibrate's answers when the body gives no max_new_tokens (the CLI's default too)


@dataclass(frozen=True)
class ProxyCall:
    prompt: Prompt
    config: CalibrationConfig


@dataclass(frozen=True)
class CalibrateCall:
    prompt: Prompt
    config: CalibrationConfig
    generate: bool
    max_new_tokens: int
    stop: tuple[str, ...]
    return_embeddings: bool
    embeddings_dtype: str
    embeddings_rows: str
    timeout_s: float | None
    time_budget_s: float | None
    reuse: str | None = None


class Validator:
    """Holds the engine, the settings and the model's preset with the server's caps applied to its defaults."""

    def __init__(self, engine, settings: ServeSettings) -> None:
        self.engine = engine
        self.settings = settings
        preset = engine.config()
        self.preset = preset.replace(max_steps=min(preset.max_steps, settings.max_steps),
                                     N=min(preset.N, settings.max_n))

    def prompt(self, request: dict, reserve: int) -> Prompt:
        """Parse and tokenize; the prompt plus `reserve` tokens must fit the model and --max-tokens."""
        prompt = self.engine.prepare(request, reserve=reserve)
        cap = self.settings.max_tokens
        if cap is not None and prompt.length + reserve > cap:
            extra = f" plus {reserve} tokens to generate" if reserve else ""
            raise LimitError(f"request {prompt.id!r}: field 'prompt': {prompt.length} tokens{extra} exceed this "
                             f"server's limit of {cap} tokens (--max-tokens)")
        return prompt

    def new_tokens(self, asked: int | None, rid: str, field: str, default: int) -> int:
        """The tokens a request's answers may take: `asked`, refused beyond --max-new-tokens; when the body gives
        none, `default` capped by it (a client is not refused for a value it never sent)."""
        cap = self.settings.max_new_tokens
        if asked is None:
            return min(default, cap)
        if asked > cap:
            raise LimitError(f"request {rid!r}: field {field!r}: {asked} exceeds this server's limit of {cap} "
                             "(--max-new-tokens)")
        return asked

    def config(self, knobs, rid: str) -> CalibrationConfig:
        over = knobs.model_dump(exclude_none=True) if knobs is not None else {}
        for name, cap, flag in (("max_steps", self.settings.max_steps, "--max-steps"),
                                ("N", self.settings.max_n, "--max-n")):
            if name in over and over[name] > cap:
                raise LimitError(f"request {rid!r}: field 'config.{name}': {over[name]} exceeds this server's "
                                 f"limit of {cap} ({flag})")
        try:
            return self.engine.config(self.preset, **over)
        except SiclError as exc:
            raise RequestError(f"request {rid!r}: field 'config': {exc}") from None

    def proxy(self, body: ProxyBody) -> ProxyCall:
        check_text(body.model_dump(), "body")  # every string, before any work (requests.check_text)
        prompt = self.prompt(body.request, reserve=0)
        return ProxyCall(prompt, self.config(body.config, prompt.id))

    def calibrate(self, body: CalibrateBody) -> CalibrateCall:
        check_text(body.model_dump(), "body")
        rid = str(body.request.get("id"))
        stop = check_stops(body.stop, f"request {rid!r}: stop") if body.stop is not None else ("\n",)
        new = self.new_tokens(body.max_new_tokens, rid, "max_new_tokens", DEFAULT_NEW_TOKENS) if body.generate else 0
        prompt = self.prompt(body.request, reserve=new)
        return CalibrateCall(
            prompt=prompt, config=self.config(body.config, prompt.id), generate=body.generate,
            max_new_tokens=new, stop=stop,
            return_embeddings=body.return_embeddings, embeddings_dtype=body.embeddings_dtype,
            embeddings_rows=body.embeddings_rows, timeout_s=body.timeout_s, time_budget_s=body.time_budget_s,
            reuse=body.reuse)
