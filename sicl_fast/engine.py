"""Engine: one loaded model + one backend; requests in, proxies / calibrations / answers out.

    eng = Engine()                                  # embedded SmolLM2-135M, backend 'auto'
    prompt = eng.prepare({"id": "q1", "demos": [...], "query": "..."})
    res = eng.calibrate(prompt, max_steps=20)       # CalibrationResult
    res = eng.calibrate(prompt, time_budget_s=2.0)  # the best X after the first step boundary past 2 s
    eng.generate(prompt, res.embeddings).answer     # greedy answer from the calibrated embeddings
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any
from collections.abc import Sequence

import torch

from .calibration.ascent import CalibrationConfig, CalibrationResult, Calibrator
from .backends import build_backend
from .run.checks import check_embeddings, check_prompt, check_step_memory
from .run.memory import form_of
from .errors import SiclError
from .backends.generate import Generation
from .models import LoadedModel, load
from .calibration.packed import check_packable, run_packed
from .run.plan import Choices, RunPlan, confirm_plan, make_plan, resolve_reuse
from .step.proxy import ProxyOut
from .formats.requests import Request, parse_request
from .run.run_args import BestAt, check_budget, stop_check
from .formats.spans import Prompt, tokenize
from .calibration.static import StepCache, run_static
from .answering.answer import answer_batch, answer_one
from .answering.reuse import Reuser
from .store import DEFAULT_MAX_BYTES, CalibrationStore


class Engine:
    """lm: a LoadedModel (or None to load `model` with `dtype` / `device`, default 'auto': CUDA where there is one,
    and the precision that calibrates as float32 does there, sicl_fast.models.loading.resolve_dtype; a name or a path
    given as lm, or those three beside lm, are refused: check_engine_args). Every other argument is a choice of the run
    plan (sicl_fast.run.plan: resolved once here, with every refusal, into `self.plan`; `sicl-fast plan` prints it):
    backend; impl, the implementation of the hot ops ('auto', 'torch', 'cpp', 'triton'; sicl_fast.ops); attn,
    attn_precision and diff_matmul, the fast decoder's attention kernel, its float32 products ('auto': 3 TF32 products
    on the tensor cores with the Triton kernel; 'ieee': IEEE float32) and difference products; loop, how calibrations
    run: 'static' (the sync-free step of sicl_fast.calibration.static, reading its state every `sync_every` steps),
    'eager' (the reference loop, Calibrator.run), 'auto' (static where the backend supports it); both give the same
    result. pack: calibrate_many runs up to `pack` prompts at once through one batched forward
    (sicl_fast.calibration.packed); 'auto': where it pays (8 on CUDA for a model under 1B parameters, else 1:
    sicl_fast.run.plan.auto_pack). grad: this engine will run the exact-gradient ascent (estimator 'grad'): impl 'auto'
    then picks the differentiable torch ops, and a backend, impl or model that cannot be differentiated is refused here;
    its calibrations run on the eager loop (the static and packed steps are zeroth-order only). graphs: 'auto' (on for
    CUDA), 'on', 'off': static-loop calibrations replay a CUDA graph of the step, captured once per prompt shape, and
    the fast backend decodes through captured graphs (sicl_fast.run.graphs); at most `graph_cache` graphs of each kind
    are kept (None: 4, 16 with length buckets). Results equal the uncaptured path's. The packed step (pack > 1) runs
    uncaptured. length_buckets: 'auto' (4 where graphs are on), 'off', or a power of two K: the static step runs padded
    to a ladder of K lengths a doubling, so that prompts of nearby lengths share one step and its graph
    (sicl_fast.run.buckets); results equal the unpadded step's up to the products' summation order. reuse: what
    `calibrate` does by default with the calibration store (sicl_fast.answering.reuse): 'off' (calibrate every prompt),
    'auto' (reuse stored calibrations where exact), 'on' (reuse them always); unset, 'auto' when a store or store_dir is
    given (else 'off'). store: a CalibrationStore (shared between engines if you like); else one is made with
    `store_bytes` of memory (default sicl_fast.store.DEFAULT_MAX_BYTES) and, with `store_dir`, a
    directory on disk (shared by processes). threads: torch's and the C++ ops' thread count, for the whole process
    (None: OMP_NUM_THREADS when set, else the cores this process may use; sicl_fast.run.threads). plan: the RunPlan
    of these same arguments made before the model loaded (sicl_fast.run.planned, which a command makes to check a
    resume before any weight is read): the engine's plan once the loaded weights confirm it (run.plan.confirm_plan),
    so that what was checked is what runs; None: made here."""

    def __init__(
        self,
        lm: LoadedModel | None = None,
        backend: str = "auto",
        add_special_tokens: bool = False,
        model: str | os.PathLike | None = None,
        dtype: str | None = None,
        device: str | None = None,
        diff_matmul: str = "auto",
        impl: str = "auto",
        loop: str = "auto",
        sync_every: int | None = None,
        pack: int | str = 1,
        grad: bool = False,
        graphs: str = "auto",
        graph_cache: int | None = None,
        length_buckets: int | str = "auto",
        attn: str = "auto",
        attn_precision: str = "auto",
        reuse: str | None = None,
        store: CalibrationStore | None = None,
        store_dir: str | os.PathLike | None = None,
        store_bytes: int | None = None,
        threads: int | None = None,
        plan: RunPlan | None = None,
    ) -> None:
        check_engine_args(lm, model=model, dtype=dtype, device=device, store=store, store_dir=store_dir,
                          store_bytes=store_bytes)
        reuse = default_reuse(reuse, store is not None or store_dir is not None, pack)
        choices = Choices(backend=backend, impl=impl, attn=attn, attn_precision=attn_precision,
                          diff_matmul=diff_matmul, loop=loop,
                          sync_every=sync_every, graphs=graphs, graph_cache=graph_cache,
                          length_buckets=length_buckets, pack=pack, grad=grad,
                          reuse=reuse, threads=threads)  # every choice checked before the store or the model
        self.store = store if store is not None else CalibrationStore(
            DEFAULT_MAX_BYTES if store_bytes is None else store_bytes, store_dir)
        self._reuser = None
        self.lm = lm if lm is not None else load(model, dtype=dtype or "auto", device=device or "auto")
        plan = make_plan(self.lm, choices) if plan is None else confirm_plan(plan, self.lm, choices)
        self.backend = build_backend(plan, self.lm)
        self.add_special_tokens = add_special_tokens
        self.steps = None  # the static steps and their graphs, per prompt shape
        self._running = threading.Lock()  # held by the calibration that runs (run): one at a time
        self._scheduler = None
        self._scheduler_guard = threading.Lock()  # threads asking for the scheduler at once get one, not one each
        self.step_hook = None  # on_step(step, proxy) of every calibration run without its own (sicl_fast.run.progress)
        if self.plan.graphs or self.plan.length_buckets:
            self.steps = StepCache(self.lm.device, self.plan.graph_cache, self.plan.length_buckets,
                                   graphs=self.plan.graphs)
        if self.plan.graphs:
            self.backend.use_graphs(self.plan.graph_cache)

    @property
    def plan(self):
        """The run plan (sicl_fast.run.plan.RunPlan): the backend's, which a fallback after a failed check of a
        captured step replaces (sicl_fast.run.graphs.first_replay: the plan's `fallback` says which and why)."""
        return self.backend.plan

    @plan.setter
    def plan(self, plan) -> None:
        self.backend.plan = plan

    def prepare(self, request: Request | dict[str, Any], reserve: int = 0) -> Prompt:
        """Tokenize a request (either JSON form or a Request); `reserve` tokens must fit after it."""
        if not isinstance(request, Request):
            request = parse_request(request)
        return tokenize(request, self.lm.tokenizer, self.add_special_tokens, self.lm.max_context, reserve)

    def config(self, config: CalibrationConfig | None = None, **overrides) -> CalibrationConfig:
        """The model's preset (or `config`) with overrides; None values are ignored."""
        if config is None:
            return CalibrationConfig.for_model(self.lm, **overrides)
        return config.with_overrides(**overrides)

    def proxy(
        self, prompt: Prompt, config: CalibrationConfig | None = None, embeds: torch.Tensor | None = None
    ) -> ProxyOut:
        """f(X) and its parts for the prompt's own embeddings (or `embeds` [L, d])."""
        cal = Calibrator(self.backend, self.config(config))
        return cal.proxy_of(self._embeddings(prompt, embeds).unsqueeze(0), prompt)

    def _embeddings(self, prompt: Prompt, embeds: torch.Tensor | None) -> torch.Tensor:
        """X [L, d] for a prompt of this model: its own embeddings, or `embeds` checked against it."""
        check_prompt(prompt, self.lm)
        return self.backend.embed(prompt) if embeds is None else check_embeddings(embeds, prompt, self.lm)

    def calibrate(self, prompt: Prompt, config: CalibrationConfig | None = None, on_step=None, reuse: str | None = None,
                  time_budget_s: float | None = None, should_stop=None, best_at: Sequence[int] = (),
                  **overrides) -> CalibrationResult:
        """Calibrate a prompt. reuse (default: the plan's): 'off' runs it on the plan's loop; 'auto' / 'on' go
        through the store and return a ReusedResult (a CalibrationResult that says whether it reused, which key,
        whether exact, and holds the stored Calibration in `.calibration`). Run arguments (sicl_fast.run.run_args; they
        do not change what a step computes): time_budget_s, stop at the first step boundary (static loop: read of
        the state) after that many seconds with the best X so far and stop_reason "time_budget"; should_stop, a
        hook checked there too (a returned string ends the run with that reason). Both also end a wait for the
        same calibration running elsewhere (the store's single flight and disk lock: docs/store.md); best_at, step
        counts at which the best X is kept (the result's best_at; a calibration from the store has no run: reuse
        'off' only)."""
        cfg = self.config(config, **overrides)
        mode = self.reuse_mode(reuse, keeps_best=bool(best_at))
        should_stop = stop_check(should_stop, check_budget(time_budget_s, "Engine.calibrate"), time.perf_counter())
        if mode != "off":
            return self.reuser.calibrate(prompt, cfg, mode, on_step=on_step, should_stop=should_stop)
        return self.run(prompt, cfg, on_step=on_step, should_stop=should_stop, best_at=best_at)

    def run(self, prompt: Prompt, cfg: CalibrationConfig, on_step=None, should_stop=None, on_update=None,
            best_at: Sequence[int] = ()) -> CalibrationResult:
        """One calibration on this engine's loop, without the store (hooks as Calibrator.run's). One at a time: a
        second while one runs (another thread's, or the one its scheduler holds between two steps) is refused, as
        the two would share the engine's buffers (and its static steps)."""
        kept = BestAt(best_at, "Engine.calibrate")
        on_step = on_step if on_step is not None else self.step_hook
        if not self._running.acquire(blocking=False):
            raise SiclError("Engine.calibrate: another calibration is running on this engine (another thread's, or "
                            "its scheduler's between two steps), and an engine runs one at a time: wait for it, or "
                            "give both to engine.scheduler()")
        try:
            if self.plan.loop_for(cfg.estimator) == "static":
                return run_static(self.backend, cfg, prompt, sync_every=self.plan.sync_every, on_step=on_step,
                                  should_stop=should_stop, steps=self.steps, on_update=on_update, best_at=kept)
            return Calibrator(self.backend, cfg).run(prompt, on_step=on_step, should_stop=should_stop,
                                                     on_update=on_update, best_at=kept)
        finally:
            self._running.release()

    @property
    def calibrating(self) -> bool:
        """Is a calibration running on this engine (run: any thread's, its scheduler's between two steps too)?"""
        return self._running.locked()

    def reuse_mode(self, reuse: str | None = None, keeps_best: bool = False) -> str:
        """The store mode calibrate runs with: the plan's (or `reuse`), refused with best_at (keeps_best): a
        calibration from the store has no run to keep it from."""
        if reuse is None and not keeps_best:
            return self.plan.reuse  # resolved and checked when the plan was made
        return resolve_reuse(self.plan.reuse if reuse is None else reuse, 1, keeps_best=keeps_best)[0]

    def stored_result(self, prompt: Prompt, config: CalibrationConfig | None = None, reuse: str | None = None,
                      **overrides) -> CalibrationResult | None:
        """What calibrate(prompt, config, reuse=reuse) returns when the store's memory already holds the
        calibration that serves the prompt: that result, at once (no run, no wait for another caller, no disk
        read); None when calibrate would run, wait or read the disk, and with reuse 'off'
        (answering.reuse.Reuser.stored)."""
        cfg = self.config(config, **overrides)
        mode = self.reuse_mode(reuse)
        return None if mode == "off" else self.reuser.stored(prompt, cfg, mode)

    def scheduler(self, limits=None):
        """This engine's scheduler (sicl_fast.scheduler.Scheduler), started on first use: requests submitted to it
        from any number of threads (or asyncio tasks) share the engine, answers decoding together in one batch per
        calibration, calibrations stepping between them. limits: a scheduler.Limits (the default's on first use;
        another while one runs is refused). Once it runs, give the engine's work to it, not to the engine's own
        methods from other threads."""
        from .scheduler import Limits, Scheduler

        with self._scheduler_guard:
            current = self._scheduler
            if current is not None and not current.closed:
                if limits is not None and limits != current.limits:
                    raise SiclError("Engine.scheduler: this engine's scheduler already runs with other limits; close "
                                    "it first (scheduler().close())")
                return current
            self._scheduler = Scheduler(self, limits or Limits())
            return self._scheduler

    @property
    def reuser(self) -> Reuser:
        if self._reuser is None:
            self._reuser = Reuser(self, self.store)
        return self._reuser

    def answer(self, calibration, query, max_new_tokens: int = 32, stop_strings=("\n",), stop_fn=None) -> Generation:
        """The greedy answer to `query` (a Prompt, or a request in either form, whose rows [0, b) are the
        calibration's) from a stored Calibration (or a ReusedResult holding one): sicl_fast.answering.answer."""
        return answer_one(self, calibration, query, max_new_tokens, stop_strings, stop_fn)

    def answer_many(self, calibration, queries, max_new_tokens: int = 32, stop_strings=("\n",)) -> list[Generation]:
        """Greedy answers to many queries on one stored calibration, decoded as one batch (answering.answer)."""
        return answer_batch(self, calibration, queries, max_new_tokens, stop_strings)

    def check_steps(self, prompts: Sequence[Prompt], configs: Sequence[CalibrationConfig | None]) -> None:
        """Refuse, before any work, what calibrating each of `prompts` under each of `configs` (as `config` takes
        them) would refuse on the way: a step too big for the memory free (run.checks.check_step_memory, `pack` such
        steps at once where the plan packs the zeroth-order steps) and, packed, prompts whose rotary tables differ
        (calibration.packed.check_packable). The calibrate and icleval commands call it before their results file is
        opened, so that a refused run leaves none behind."""
        packed = False
        for config in configs:
            cfg = self.config(config)
            pack = self.plan.pack if cfg.estimator != "grad" else 1  # the exact gradient never runs packed
            packed |= pack > 1
            for p in prompts:
                check_step_memory(self.lm, p, cfg, pack=pack, form=form_of(self.plan))
        if packed:
            check_packable(self.backend, prompts)

    def calibrate_many(self, prompts, config: CalibrationConfig | None = None, on_result=None,
                       time_budget_s: float | None = None, best_at: Sequence[int] = (),
                       **overrides) -> list[CalibrationResult]:
        """Calibrate every prompt, `pack` at once when pack > 1 (sicl_fast.calibration.packed), else one by one. With
        on_result(i, result), each result goes there as it finishes and nothing is kept (a long run's memory
        stays flat); without, the results come back in the order of `prompts`. time_budget_s and best_at: each
        prompt's, as calibrate's."""
        cfg = self.config(config, **overrides)
        time_budget_s = check_budget(time_budget_s, "Engine.calibrate_many")
        BestAt(best_at, "Engine.calibrate_many")  # the counts checked before any work
        self.plan.check_pack(cfg.estimator)
        if self.plan.pack > 1:
            return run_packed(self.backend, [(p, cfg) for p in prompts], self.plan.pack, self.plan.sync_every,
                              on_result, time_budget_s=time_budget_s, best_at=best_at)
        results = []
        for i, p in enumerate(prompts):
            res = self.calibrate(p, cfg, time_budget_s=time_budget_s, best_at=best_at)
            if on_result is None:
                results.append(res)
            else:
                on_result(i, res)
        return results

    def generate(
        self,
        prompt: Prompt,
        embeds: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        stop_strings=("\n",),
        stop_fn=None,
    ) -> Generation:
        """Greedy answer from `embeds` [L, d] (default: the prompt's own embeddings)."""
        X = self._embeddings(prompt, embeds)
        return self.backend.generate(X, prompt, max_new_tokens, stop_strings=stop_strings, stop_fn=stop_fn)


def check_engine_args(lm, **given) -> None:
    """Engine's arguments that cannot work together, refused before anything is made: `lm` must be a loaded model
    (a name or a path goes to model=); model, dtype and device load one, so they are refused beside `lm`; a ready
    `store` is refused beside store_dir and store_bytes, which make one. `given`: those arguments (None: not
    given)."""
    if lm is not None and not isinstance(lm, LoadedModel):
        if isinstance(lm, (str, os.PathLike)):
            raise SiclError(f"Engine: the first argument is a loaded model (sicl_fast.load(...)), got the "
                            f"{type(lm).__name__} {str(lm)!r}; to load it pass model=: Engine(model={str(lm)!r})")
        raise SiclError(f"Engine: the first argument must be a LoadedModel (sicl_fast.load(...), or "
                        f"sicl_fast.models.from_transformers(model, tokenizer)), got {type(lm).__name__}")
    for uses, names in ((lm, ("model", "dtype", "device")), (given["store"], ("store_dir", "store_bytes"))):
        both = [n for n in names if given[n] is not None]
        if uses is not None and both:
            what = "lm (a loaded model)" if uses is lm else "store (a CalibrationStore)"
            raise SiclError(f"Engine: {' and '.join(both)} would be ignored beside {what}: they make what it "
                            "already is; pass one or the other")


def default_reuse(reuse: str | None, has_store: bool, pack: int | str) -> str | None:
    """Engine's reuse: as given; unset, 'off', or the plan's default ('auto' unless the plan packs) when a store is
    given (store or store_dir: a store asked for is meant to be used). A store with pack > 1 and no reuse is
    refused: the packed step calibrates without it, and nothing would go into it."""
    if reuse is not None or not has_store:
        return reuse if reuse is not None else "off"
    if pack != "auto" and pack > 1:
        raise SiclError(f"Engine: a store with pack {pack} is not used (the packed step calibrates without it); "
                        "pass reuse='off' to keep it for calibrate(..., reuse='auto') calls, or pack=1")
    return None
