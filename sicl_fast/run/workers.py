"""Where per-request work runs: in this process (LocalWorkers) or on a Ray pool (commands.distributed.RayPool).

Both give the driver the same surface, so `calibrate` and `icleval` are written once:

    workers.model_name                 the engine's model name (records carry it)
    workers.settings                   the engine's part of the records' settings (sicl_fast.run.settings)
    workers.facts                      all the driver knows of the engine (engine_facts)
    workers.config(**overrides)        the model's preset CalibrationConfig with overrides (None values ignored)
    workers.call(fn, *args)            fn(engine, *args) on one engine; for checks that must pass before any work
    workers.watch_steps(hook)          hook(step, proxy) for every calibration step of a local run (the progress
                                       line, sicl_fast.run.progress); a Ray pool's steps are not watched
    workers.imap(fn, items)            fn(engine, item) for every item, yielding Done(index, value) or
                                       Lost(index, message) as they finish (Lost: the Ray workers running it died
                                       too often; a local run raises instead)

A work function is a module-level function (Ray sends it by reference) of (engine, ...) that returns plain
picklable values (records). Its result must depend on its arguments only: the calibration seed is in the config,
so a request gives the same record on any worker and for any number of workers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable, Iterator


@dataclass(frozen=True)
class Done:
    index: int  # position of the item in the list given to imap
    value: Any


@dataclass(frozen=True)
class Lost:
    index: int
    message: str  # why the item could not be run (e.g. its worker was killed, out of memory)


Outcome = Done | Lost


def engine_facts(engine) -> dict:
    """What the driver needs to know about the engine without holding the model: its name, family, parameter count
    and config preset, what it computes on (the plan's thread count and torch's, which the plan set) and its part of
    the records' settings (sicl_fast.run.settings.engine_settings)."""
    import torch

    from .settings import engine_settings

    return {"name": engine.lm.name, "family": engine.lm.family,
            "n_params": sum(p.numel() for p in engine.lm.model.parameters()), "preset": engine.config(),
            "threads": engine.plan.threads, "torch_threads": torch.get_num_threads(),
            "settings": engine_settings(engine)}


class Workers:
    """The common driver-side part: the facts asked once, config() from the preset."""

    _facts: dict | None = None

    def call(self, fn: Callable, *args):  # pragma: no cover - interface
        raise NotImplementedError

    def imap(self, fn: Callable, items: Iterable) -> Iterator[Outcome]:  # pragma: no cover - interface
        raise NotImplementedError

    def _known(self) -> dict:
        if self._facts is None:
            self._facts = self.call(engine_facts)
        return self._facts

    @property
    def model_name(self) -> str:
        return self._known()["name"]

    @property
    def facts(self) -> dict:
        """engine_facts of the engine (of one of them)."""
        return self._known()

    @property
    def settings(self) -> dict:
        """The engine's part of the records' settings (sicl_fast.run.settings.engine_settings)."""
        return self._known()["settings"]

    def config(self, config=None, **overrides):
        """Same rule as Engine.config: the preset (or `config`) with the non-None overrides."""
        base = self._known()["preset"] if config is None else config
        return base.with_overrides(**overrides)

    def watch_steps(self, hook) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalWorkers(Workers):
    """Everything in this process, in order, on one Engine; errors propagate as raised."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def call(self, fn: Callable, *args):
        return fn(self.engine, *args)

    def watch_steps(self, hook) -> None:
        self.engine.step_hook = hook

    def imap(self, fn: Callable, items: Iterable) -> Iterator[Outcome]:
        for i, item in enumerate(items):
            yield Done(i, fn(self.engine, item))


def write_all(workers: Workers, fn: Callable, items: list, out, lost_records: Callable, bar=None,
              on_step=None) -> int:
    """The driver loop of calibrate and icleval: fn(engine, item) -> list of records for each item, written by the
    driver alone (`out`, a ResultWriter) as they arrive, each a whole line. An item that could not be run gets
    lost_records(item, message) instead. `bar` (tqdm) advances by one per record; on_step watches the steps of
    each calibration meanwhile (Workers.watch_steps). Returns the records written."""
    n = 0
    workers.watch_steps(on_step)
    try:
        for res in workers.imap(fn, items):
            recs = res.value if isinstance(res, Done) else lost_records(items[res.index], res.message)
            for rec in recs:
                out.write(rec)
            n += len(recs)
            if bar is not None:
                bar.update(len(recs))
    finally:
        workers.watch_steps(None)
    return n


def as_workers(engine_or_workers) -> Workers:
    """An Engine becomes LocalWorkers on it; Workers pass through."""
    return engine_or_workers if isinstance(engine_or_workers, Workers) else LocalWorkers(engine_or_workers)


__all__ = ["Done", "Lost", "Outcome", "Workers", "LocalWorkers", "as_workers", "engine_facts", "write_all"]
