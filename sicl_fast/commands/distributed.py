"""Ray: a pool of engine actors (one model each) that runs work functions for the driver, with retry on death.

    with RayPool(engine_kwargs, workers=2) as pool:        # starts a local Ray, or joins one (address=)
        pool.config(max_steps=20)                           # the model's preset, asked of a worker
        for out in pool.imap(work_fn, items): ...           # Done / Lost as the workers finish (sicl_fast.run.workers)

* Requests are dealt one at a time to whichever actor is free, so a slow prompt never holds back a shard.
* The driver alone writes results (the caller's ResultWriter); actors only return records.
* An actor that dies while running an item (killed, out of memory) or whose work raises something other than a
  SiclError is replaced by a fresh actor, and the item goes back to the front of the queue on another actor, at
  most `max_retries` times; then it comes out as Lost(message). Nothing else is affected.
* A SiclError in a work function (bad input) stops the run with that error, as it would in one process.
* Each actor's engine runs on as many threads as it has CPUs (the engine's `threads`, unless the caller gave
  one), so W actors do not oversubscribe the cores.

Ray is optional (`pip install "sicl-fast[ray]"`); this module imports it only when a pool starts.
"""
from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Callable, Iterable, Iterator

from ..errors import SiclError, first_line, require
from ..run.knobs import check_range
from ..run.workers import Done, Lost, Outcome, Workers

LOCAL = "local"  # the address meaning "start a local Ray" (what `--ray` without an address gives)
WAIT_NOTE_S = 300.0  # say so (once) when nothing has come back for this long: maybe an actor Ray cannot place


def require_ray():
    """The ray module, or a MissingExtraError naming the extra to install (sicl_fast.errors.require)."""
    require("ray")
    import ray

    return ray


class EngineActor:
    """One Engine in one Ray worker process. Methods return ("ok", value) or ("error", message) for a SiclError,
    so bad input reaches the driver as a SiclError rather than as a wrapped Ray traceback."""

    def __init__(self, engine_kwargs: dict) -> None:
        from ..engine import Engine

        self.engine, self.init_error = None, None
        try:
            self.engine = Engine(**engine_kwargs)
        except SiclError as exc:  # e.g. an unknown model: reported by the first call, not as a dead actor
            self.init_error = str(exc)

    def run(self, fn: Callable, *args):
        if self.init_error is not None:
            return "error", self.init_error
        try:
            return "ok", fn(self.engine, *args)
        except SiclError as exc:
            return "error", str(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. CUDA out of memory: retried on a fresh actor
            return "failed", f"{type(exc).__name__}: {exc}"


class RayPool(Workers):
    """`workers` actors of EngineActor(engine_kwargs). address: None or "local" starts a local Ray (ray.init()),
    "auto" or "ray://host:port" joins a cluster (an already initialised Ray in this process is used as is).
    cpus_per_worker: default the cluster's CPUs // workers; gpus_per_worker: default 1 when the engine's device is
    CUDA, else 0. max_retries: how often an item is retried after its worker died."""

    def __init__(self, engine_kwargs: dict, workers: int = 1, address: str | None = None,
                 cpus_per_worker: int | None = None, gpus_per_worker: float | None = None,
                 max_retries: int = 2) -> None:
        for name, v in (("workers", workers), ("max_retries", max_retries), ("cpus_per_worker", cpus_per_worker),
                        ("gpus_per_worker", gpus_per_worker)):
            if v is not None:
                check_range(name, v, "RayPool")
        ray = require_ray()
        self._ray = ray
        self.engine_kwargs = dict(engine_kwargs)
        self.max_retries = max_retries
        self.restarts = 0  # actors started to replace dead ones
        self._noted = False  # the waiting note was printed
        self._started_ray = False
        if not ray.is_initialized():
            addr = None if address in (None, LOCAL) else address
            try:
                ray.init(address=addr, include_dashboard=False, logging_level=logging.WARNING)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise SiclError(f"--ray {address}: could not start or join Ray: {first_line(exc)}") from None
            self._started_ray = True
        res = ray.cluster_resources()
        cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
        if gpus_per_worker is None:  # a GPU each where the engines run on CUDA ('auto': where the cluster has GPUs)
            device = self.engine_kwargs.get("device") or "auto"
            gpus_per_worker = int(gpus > 0) if device == "auto" else int(str(device).startswith("cuda"))
        if cpus_per_worker is None:
            cpus_per_worker = max(1, cpus // workers)
        for what, per, have in (("CPU", cpus_per_worker, cpus), ("GPU", gpus_per_worker, gpus)):
            if workers * per > have:
                self.close()
                raise SiclError(f"{workers} workers x {per} {what} each need {workers * per} {what}s; the Ray "
                                f"cluster has {have} (lower --workers or --{what.lower()}s-per-worker)")
        if gpus_per_worker > 0 and ":" in str(self.engine_kwargs.get("device", "")):
            # Ray gives each actor its own GPU(s) through CUDA_VISIBLE_DEVICES: inside, that GPU is "cuda"
            self.engine_kwargs["device"] = "cuda"
        self.cpus_per_worker, self.gpus_per_worker = cpus_per_worker, gpus_per_worker
        if self.engine_kwargs.get("threads") is None:  # an actor's threads: its CPUs (the engine applies them)
            self.engine_kwargs["threads"] = cpus_per_worker
        self._actor_cls = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, max_restarts=0)(EngineActor)
        self.actors = [self._new_actor() for _ in range(workers)]
        self._inflight: dict = {}  # ObjectRef -> (actor slot, item index)

    # -- actors ---------------------------------------------------------------------------------------------------
    def _new_actor(self):
        return self._actor_cls.remote(self.engine_kwargs)

    def _replace(self, slot: int) -> None:
        """Kill the actor in `slot` (it may be dead already) and start a fresh one there."""
        try:
            self._ray.kill(self.actors[slot], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.actors[slot] = self._new_actor()
        self.restarts += 1

    def _lost_errors(self) -> tuple:
        ex = self._ray.exceptions
        names = ("RayActorError", "WorkerCrashedError", "OutOfMemoryError", "ObjectLostError", "RayTaskError")
        return tuple(getattr(ex, n) for n in names if hasattr(ex, n))

    def _result(self, ref) -> tuple[str, object]:
        """("ok", value), ("error", message) or ("failed", message); the last when the actor died or failed."""
        try:
            return self._ray.get(ref)
        except self._lost_errors() as exc:
            return "failed", first_line(exc)

    # -- Workers --------------------------------------------------------------------------------------------------
    def call(self, fn: Callable, *args):
        out = next(iter(self._run(fn, [args], star=True)))
        if isinstance(out, Lost):
            raise SiclError(out.message)
        return out.value

    def imap(self, fn: Callable, items: Iterable) -> Iterator[Outcome]:
        return self._run(fn, list(items), star=False)

    def _run(self, fn: Callable, items: list, star: bool) -> Iterator[Outcome]:
        ray = self._ray
        pending = collections.deque(range(len(items)))
        failures = collections.Counter()
        idle = collections.deque(range(len(self.actors)))
        inflight = self._inflight = {}
        while pending or inflight:
            while idle and pending:
                slot, i = idle.popleft(), pending.popleft()
                args = items[i] if star else (items[i],)
                inflight[self.actors[slot].run.remote(fn, *args)] = (slot, i)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=WAIT_NOTE_S)
            if not ready and not self._noted:
                self._noted = True
                print(f"note: nothing back from the {len(self.actors)} Ray workers for {WAIT_NOTE_S:.0f} s: long "
                      "requests, or an actor that Ray cannot place for lack of free CPUs or GPUs (it would wait "
                      "forever; `ray status` shows pending demands)", file=sys.stderr, flush=True)
            for ref in ready:
                slot, i = inflight.pop(ref)
                status, value = self._result(ref)
                if status == "ok":
                    idle.append(slot)
                    yield Done(i, value)
                    continue
                if status == "error":
                    raise SiclError(value)
                self._replace(slot)
                idle.append(slot)
                failures[i] += 1
                if failures[i] > self.max_retries:
                    yield Lost(i, f"worker failed {failures[i]} times on this item; last: {value}")
                else:
                    pending.appendleft(i)

    def busy(self) -> list[tuple]:
        """(actor handle, item index) of the work in flight now."""
        return [(self.actors[slot], i) for slot, i in self._inflight.values()]

    def close(self) -> None:
        for a in getattr(self, "actors", []):
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False


__all__ = ["RayPool", "EngineActor", "require_ray", "LOCAL"]
