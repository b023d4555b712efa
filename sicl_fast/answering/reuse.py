"""Calibrate once, answer many: which stored calibration serves a prompt, and when reusing it is exact.

The forwards, the proxy, the gate, patience and best X read rows [0, b) only (b: the end of the last output span).
The one place a query enters is the cosine projection with projection_scope "prompt", which measures cos(X, X0)
over the whole matrix. The query rows Q are the same in X and X0, so with u = <X, X0>, a = |X|^2 and c = |X0|^2
over rows [0, b) and q = |Q|^2, the whole-matrix cosine is

    cos(q) = (u + q) / sqrt((a + q)(c + q)),

whose minimum over q >= 0 is cos(0) or, when q* = (u (a + c) - 2 a c) / (a + c - 2 u) > 0, cos(q*)
(`min_whole_cosine`). If that minimum stays >= kappa + EXACT_MARGIN after every update of a run whose own
projection never fired, no query could have made the projection fire: the rows [0, b) and everything the run
reports are those of any query's own calibration, bit for bit (the result is "exact"). With projection_scope
"demos", kappa <= 0 (no projection) or a gated run it is exact always. Otherwise reusing it is an approximation.

Modes (`reuse`): "auto" reuses exact calibrations and calibrates the others per query (a miss runs the first
query's whole prompt, watched: when exact, its rows [0, b) become the stored calibration, at no extra cost);
"on" reuses every calibration (a miss calibrates rows [0, b) alone, watched), saying whether it is exact;
"off" calibrates every prompt on its own, without the store.

Per query, reuse also needs the query to leave the token ids of rows [0, b) as the instruction and demonstrations
alone tokenize (a BPE merge across the boundary can change them): `stem_matches`. Where it does not, the prompt is
calibrated on its own (reuse "boundary"). Every result says what happened (`ReusedResult`: reused, reuse, key,
exact): reuse is "hit" (a stored calibration), "fresh" (calibrated now; stored for the next queries when exact),
"per-query" (auto: calibrated for this query alone, since the stored one is not exact or the config perturbs the
query), "boundary" or "off".
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace

import torch

from ..calibration.ascent import CalibrationConfig, CalibrationResult, Calibrator
from ..run.checks import check_calibration, check_prompt
from ..errors import SiclError
from ..formats.requests import Request
from ..formats.spans import Prompt, tokenize
from ..store import Calibration, CalibrationStore, Expected, calibration_key, engine_fingerprint

EXACT_MARGIN = 1e-4  # on the cosine: far above float32 rounding of the projection's test, far below any signal
NATURAL_STOPS = ("gate", "patience", "max_steps", "snr")  # a run stopped from outside (deadline) is not kept


def min_whole_cosine(u: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The smallest whole-matrix cosine over every query norm q >= 0 (module docstring), from u = <X, X0>,
    a = |X|^2, c = |X0|^2 over rows [0, b) (float64 tensors; no host read)."""
    at0 = u / torch.sqrt(a * c)
    gap = a + c - 2 * u  # |X - X0|^2 >= 0; 0: X = X0
    q = (u * (a + c) - 2 * a * c) / torch.where(gap > 0, gap, torch.ones_like(gap))
    q = torch.where(gap > 0, q, torch.zeros_like(q)).clamp(min=0)
    at_q = (u + q) / torch.sqrt((a + q) * (c + q))
    return torch.minimum(at0, at_q)


class CosineWatch:
    """on_update hook of a calibration: the running minimum of min_whole_cosine over rows [0, b), kept on the
    device (a few small kernels a step, no host read); `low` reads it once at the end."""

    def __init__(self, X0: torch.Tensor, b: int) -> None:
        self.b = b
        self.x0 = X0[:b].detach().double()
        self.c = (self.x0 * self.x0).sum()
        self._low = torch.ones((), dtype=torch.float64, device=X0.device)

    def __call__(self, X: torch.Tensor) -> None:
        x = X[:self.b].double()
        m = min_whole_cosine((x * self.x0).sum(), (x * x).sum(), self.c)
        torch.minimum(self._low, m, out=self._low)

    @property
    def low(self) -> float:
        return float(self._low)


def watched(config: CalibrationConfig) -> bool:
    """Can a query change this config's calibration through the whole-matrix projection?"""
    return config.kappa > 0 and config.projection_scope == "prompt"


def stem_prompt(prompt: Prompt) -> Prompt:
    """The prompt's rows [0, b) alone (instruction and demonstrations): what a query-free calibration runs on."""
    b = prompt.demo_end
    return replace(prompt, input_ids=prompt.input_ids[:b].clone())


def stem_matches(prompt: Prompt, tokenizer, add_special_tokens: bool) -> bool:
    """Do the prompt's rows [0, b) hold the token ids (and spans) of its instruction and demonstrations tokenized
    alone, the text up to the end of the last output? False when the query merged into them (a BPE merge across
    the boundary)."""
    req = prompt.request
    end = req.output_spans[-1][1]
    alone = tokenize(Request(id=req.id, prompt=req.prompt[:end], output_spans=req.output_spans,
                             demos_start=req.demos_start), tokenizer, add_special_tokens)
    b = prompt.demo_end
    return (alone.demo_end == b and alone.demo_start == prompt.demo_start
            and alone.token_spans == prompt.token_spans and torch.equal(alone.input_ids[:b], prompt.input_ids[:b]))


@dataclass
class ReusedResult(CalibrationResult):
    """A CalibrationResult for one prompt (embeddings [L, d]) with how it was obtained: the stored calibration
    it came from or went into (`calibration`, None when nothing was stored), reused (from the store), reuse
    (module docstring), key (the stem's key; None when the config perturbs the query) and exact (equal to this
    prompt's own calibration)."""

    calibration: Calibration | None = None
    reused: bool = False
    reuse: str = "off"
    key: str | None = None
    exact: bool = True

    def reuse_info(self) -> dict:
        return {"reused": self.reused, "reuse": self.reuse, "key": self.key, "exact": self.exact}

    def summary(self) -> dict:
        return {**super().summary(), **self.reuse_info()}


def reuse_info(res: CalibrationResult) -> dict:
    """How `res` was obtained, for every record and reply: a ReusedResult's own; a run without the store (reuse
    'off', the packed step) says so, as a calibration of its own."""
    if isinstance(res, ReusedResult):
        return res.reuse_info()
    return {"reused": False, "reuse": "off", "key": None, "exact": True}


class Reuser:
    """The engine's reuse logic over its store (Engine.calibrate with reuse 'auto' / 'on'). It holds the engine
    weakly (the engine holds it): a dropped engine frees its steps and graphs by reference counting."""

    def __init__(self, engine, store: CalibrationStore) -> None:
        self.engine = engine if isinstance(engine, weakref.ProxyTypes) else weakref.proxy(engine)
        self.store = store
        self._fingerprint: tuple | None = None  # (the plan it was made for, the fingerprint)
        self.counts = {"reused": 0, "calibrated": 0}  # this engine's calibrations, by whether they came from the store

    @property
    def fingerprint(self) -> dict:
        """engine_fingerprint of the engine, made again when its plan changed (a fallback to the torch ops after a
        captured step failed its check changes the bits, and so the keys)."""
        plan = self.engine.plan
        if self._fingerprint is None or self._fingerprint[0] is not plan:
            self._fingerprint = (plan, engine_fingerprint(self.engine))
        return self._fingerprint[1]

    def key(self, prompt: Prompt, config: CalibrationConfig, scope: str = "stem") -> str:
        """The store key of the prompt's stem ('stem': rows [0, b)) or whole prompt ('prompt'); config resolved."""
        n = prompt.demo_end if scope == "stem" else prompt.length
        return calibration_key(self.fingerprint, prompt, config, n, scope)

    def expect(self, prompt: Prompt, scope: str) -> Expected:
        """What the store must serve for the key of this prompt's stem ('stem') or whole prompt ('prompt'): an entry
        read from disk that is not it is corrupt (sicl_fast.store.entry.Expected)."""
        return Expected.of(prompt, scope, self.engine.lm.hidden_size)

    def resolve(self, config: CalibrationConfig) -> CalibrationConfig:
        return Calibrator(self.engine.backend, config).config  # the scale resolved, as every run sees it

    # ------------------------------------------------------------------------------------------ runs

    def run(self, prompt: Prompt, config: CalibrationConfig, watch: bool, on_step=None, should_stop=None
            ) -> tuple[CalibrationResult, bool, float | None]:
        """Calibrate `prompt` on the engine, watching the whole-matrix cosine of rows [0, b) when `watch`.
        -> (result, exact for every query, the lowest whole-matrix cosine or None when not watched)."""
        cw = None
        if watch and watched(config):
            cw = CosineWatch(self.engine.backend.embed(prompt), prompt.demo_end)
        res = self.engine.run(prompt, config, on_step=on_step, should_stop=should_stop, on_update=cw)
        if cw is None:
            return res, True, None
        low = cw.low
        return res, res.projections == 0 and low >= config.kappa + EXACT_MARGIN, low

    def entry(self, key: str, scope: str, res: CalibrationResult, prompt: Prompt, exact: bool,
              low: float | None) -> Calibration | None:
        """The storable Calibration of a finished run, or None for a run stopped from outside. Its key is the one of
        the plan the run ended on: where a captured step failed its check midway and the run fell back to the torch
        ops (FastBackend.fall_back), the bits are that plan's, never stored under `key`, the one looked up before."""
        if res.stop_reason not in NATURAL_STOPS:
            return None
        n = prompt.demo_end if scope == "stem" else prompt.length
        key = self.key(prompt, res.config, scope)
        return Calibration.from_result(key, scope, res, prompt, n, self.engine.lm.name, exact, low)

    def for_prompt(self, cal: Calibration, prompt: Prompt, t0: float, reuse: str, key: str | None,
                   reused: bool = True) -> ReusedResult:
        """The result for `prompt` from a stored calibration: its rows [0, n), then the prompt's own rows."""
        same = {f: getattr(cal, f) for f in ("initial_proxy", "best_proxy", "steps", "best_step", "gated",
                                             "stop_reason", "projections", "config", "impl")}
        return ReusedResult(embeddings=full_embeddings(self.engine, cal, prompt), history=list(cal.history),
                            seconds=time.perf_counter() - t0, calibration=cal, reused=reused, reuse=reuse, key=key,
                            exact=cal.exact or cal.scope == "prompt", **same)

    @staticmethod
    def wrap(res: CalibrationResult, t0: float, cal: Calibration | None, reuse: str, key: str | None,
             exact: bool = True) -> ReusedResult:
        fields = {k: getattr(res, k) for k in CalibrationResult.__dataclass_fields__}
        fields["seconds"] = time.perf_counter() - t0
        return ReusedResult(**fields, calibration=cal, reused=False, reuse=reuse, key=key, exact=exact)

    # ------------------------------------------------------------------------------------------ modes

    def calibrate(self, prompt: Prompt, config: CalibrationConfig, mode: str, on_step=None, should_stop=None
                  ) -> ReusedResult:
        """Engine.calibrate with reuse `mode` ('auto' or 'on'; module docstring)."""
        t0 = time.perf_counter()
        cfg, key, how = self.shared(prompt, config, mode)
        res = self.hit(prompt, cfg, key, how, mode, t0) or self.route(prompt, cfg, key, how, mode, t0, on_step,
                                                                      should_stop)
        self.counts["reused" if res.reused else "calibrated"] += 1
        return res

    def shared(self, prompt: Prompt, config: CalibrationConfig, mode: str) -> tuple[CalibrationConfig, str | None, str]:
        """(config resolved, the stem's key, how the prompt can share it): 'per-query' (the config perturbs the
        query: nothing to share; key None), 'boundary' (the query changed the stem's tokens), or `mode`."""
        check_prompt(prompt, self.engine.lm)
        if mode == "off":
            raise SiclError("Reuser.calibrate: reuse 'off' runs Engine.run, without the store")
        cfg = self.resolve(config)
        if cfg.perturb_query:  # the query's rows are perturbed: nothing to share
            return cfg, None, "per-query"
        key = self.key(prompt, cfg)
        if not stem_matches(prompt, self.engine.lm.tokenizer, self.engine.add_special_tokens):
            return cfg, key, "boundary"
        return cfg, key, mode

    def stored(self, prompt: Prompt, config: CalibrationConfig, mode: str) -> ReusedResult | None:
        """What calibrate gives `prompt` when the store's memory already holds the calibration that serves it (the
        stem's, or this prompt's own): that result, at once, with no run, no wait for another caller and no disk
        read; None otherwise (calibrate would look further, wait or run). The scheduler asks before it queues a
        calibration, so that a query on a stored prompt never waits behind another prompt's calibration."""
        t0 = time.perf_counter()
        cfg, key, how = self.shared(prompt, config, mode)
        res = self.hit(prompt, cfg, key, how, mode, t0)
        if res is not None:
            self.counts["reused"] += 1
        return res

    def hit(self, prompt: Prompt, cfg: CalibrationConfig, key: str | None, how: str, mode: str, t0: float
            ) -> ReusedResult | None:
        """The result from the store's memory, as route would give it from there: the stem's calibration where it
        serves this prompt in `mode` ('on': any; 'auto': an exact one), else this prompt's own (calibrated per
        query before: reuse 'per-query' or 'boundary'); None when route would run, wait or read the disk."""
        if how == mode:
            cal = self.store.peek(key, exact=mode == "auto")
            if cal is not None:
                return self.for_prompt(cal, prompt, t0, "hit", key)
            if mode == "on":  # a miss calibrates the stem
                return None
        own = self.store.peek(self.key(prompt, cfg, "prompt"))
        return None if own is None else self.for_prompt(own, prompt, t0, how if how != mode else "per-query", key)

    def route(self, prompt: Prompt, cfg: CalibrationConfig, key: str | None, how: str, mode: str, t0: float,
              on_step=None, should_stop=None) -> ReusedResult:
        """calibrate past the memory: per query, or the store in `mode` (disk, single flight, a run)."""
        if how != mode:
            return self.per_query(prompt, cfg, how, key, t0, on_step, should_stop)
        if mode == "on":
            return self.reuse_on(prompt, cfg, key, t0, on_step, should_stop)
        return self.reuse_auto(prompt, cfg, key, t0, on_step, should_stop)

    def reuse_on(self, prompt, cfg, key, t0, on_step, should_stop) -> ReusedResult:
        """Reuse whatever is stored; a miss calibrates rows [0, b) alone (watched) and stores it."""
        done = {}

        def compute():
            stem = stem_prompt(prompt)
            res, exact, low = self.run(stem, cfg, watch=True, on_step=on_step, should_stop=should_stop)
            done["res"] = res
            return self.entry(key, "stem", res, stem, exact, low)

        cal, hit = self.store.get_or_compute(key, compute, should_stop, self.expect(prompt, "stem"))
        if cal is None:  # stopped from outside: this query's answer from the partial run, nothing kept
            partial = Calibration.from_result(key, "stem", done["res"], stem_prompt(prompt), prompt.demo_end,
                                              self.engine.lm.name, False, None)
            return self.for_prompt(partial, prompt, t0, "fresh", key, reused=False)
        return self.for_prompt(cal, prompt, t0, "hit" if hit else "fresh", key, reused=hit)

    def reuse_auto(self, prompt, cfg, key, t0, on_step, should_stop) -> ReusedResult:
        """Reuse an exact stored calibration (or this prompt's own, stored earlier); a miss calibrates the whole
        prompt, watched, and stores its rows [0, b) when that is exact for every query."""
        cal = self.store.get(key, should_stop, self.expect(prompt, "stem"))
        if cal is not None and not cal.exact:
            return self.per_query(prompt, cfg, "per-query", key, t0, on_step, should_stop)
        own_key = self.key(prompt, cfg, "prompt")
        if cal is None and (own := self.store.get(own_key, should_stop, self.expect(prompt, "prompt"))) is not None:
            return self.for_prompt(own, prompt, t0, "per-query", key)
        done = {}

        def compute():
            res, exact, low = self.run(prompt, cfg, watch=True, on_step=on_step, should_stop=should_stop)
            done.update(res=res, exact=exact, low=low)
            return self.entry(key, "stem", res, prompt, exact, low) if exact else None

        cal, hit = self.store.get_or_compute(key, compute, should_stop, self.expect(prompt, "stem"))
        if hit:
            if cal.exact:
                return self.for_prompt(cal, prompt, t0, "hit", key)
            return self.per_query(prompt, cfg, "per-query", key, t0, on_step, should_stop)
        res = done["res"]
        if cal is not None:
            return self.wrap(res, t0, cal, "fresh", key)
        own = self.entry(own_key, "prompt", res, prompt, True, done["low"])  # query-dependent: kept for reruns
        if own is not None:
            self.store.put(own, should_stop)
        return self.wrap(res, t0, own, "per-query", key)

    def per_query(self, prompt, cfg, reuse: str, key: str | None, t0, on_step, should_stop) -> ReusedResult:
        """This prompt calibrated on its own (or its own stored calibration, from an earlier run)."""
        own_key = self.key(prompt, cfg, "prompt")
        done = {}

        def compute():
            res, _, _ = self.run(prompt, cfg, watch=False, on_step=on_step, should_stop=should_stop)
            done["res"] = res
            return self.entry(own_key, "prompt", res, prompt, True, None)

        cal, hit = self.store.get_or_compute(own_key, compute, should_stop, self.expect(prompt, "prompt"))
        if hit:
            return self.for_prompt(cal, prompt, t0, reuse, key)
        return self.wrap(done["res"], t0, cal, reuse, key)



def fits(cal: Calibration, prompt: Prompt, lm) -> None:
    """Refuse a prompt that a stored calibration cannot serve on model `lm`: the calibration must be of the model's
    width (checks.check_calibration) and its rows [0, n) must hold the same token ids, spans and first
    demonstration row (else the query changed them: calibrate it, Engine.calibrate says 'boundary')."""
    check_calibration(cal, lm, f"request {prompt.id!r}")
    n = cal.length
    ok = (prompt.length >= n and prompt.token_spans == cal.token_spans and prompt.demo_start == cal.demo_start
          and torch.equal(prompt.input_ids[:n], cal.input_ids))
    if not ok:
        other = f" (a calibration of model {cal.model!r}; this engine's is {lm.name!r})" if cal.model != lm.name else ""
        raise SiclError(f"request {prompt.id!r}: its first {n} tokens (instruction and demonstrations) are not those "
                        f"of calibration {cal.key[:12]}{other}: calibrate it (Engine.calibrate with reuse 'auto' "
                        "calibrates it on its own and says reuse 'boundary')")


def full_embeddings(engine, cal: Calibration, prompt: Prompt) -> torch.Tensor:
    """X [L, d] float32 for `prompt` from a stored calibration: its rows [0, n), then the prompt's own embeddings."""
    fits(cal, prompt, engine.lm)
    X = engine.backend.embed(prompt)
    X[:cal.length] = cal.rows.to(X.device)
    return X


__all__ = ["EXACT_MARGIN", "min_whole_cosine", "CosineWatch", "watched", "stem_prompt",
           "stem_matches", "ReusedResult", "Reuser", "fits", "full_embeddings", "reuse_info"]
