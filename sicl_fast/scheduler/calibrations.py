"""The calibrations in flight, and the calls on the engine: the scheduler's other lane.

    lane = CalibrationLane(engine)
    lane.takes(item)              can it start now (a free slot)?
    lane.start(owner, item, stop_reason)
    done = lane.unit()            one unit -> [(owner, result | None, error)]

With pack 1 (the CPU) calibrations run one at a time, each as Engine.calibrate itself in turns (a Coroutine: it hands
the engine back at every step boundary), so the store, reuse and every loop serve it as they serve a direct call,
and its result is the one it has alone. With pack > 1 (`--pack auto` on a GPU for a model under 1B parameters),
calibrations without the store (reuse 'off', the packed step's rule: run.plan.resolve_reuse) run as slots of one
packed step (calibration.packed.PackedRun): a calibration joins at the next read and leaves at its own stop, with
its own config, seed, time budget, deadline and cancellation (and
its on_step's failure: OwnSteps); the others (reuse 'auto' / 'on', the exact gradient)
run one at a time beside it. A unit is one turn of each: a read interval of the packed step, a step (or read
interval) of the one-at-a-time calibration, or one call (a proxy), in turn with them.

Each kind of work keeps the rotary tables it ran with (Transformer.rope_lengths) and has them back at its next turn:
a rope type that depends on the prompt length (Phi-3's longrope past its threshold) holds one length's tables, and
other work may fit another's in between.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque

from ..calibration.packed import PackedRun
from .coroutine import Coroutine
from .work import Calibrate, Call


# engine -> the lane whose one-at-a-time calibration runs on it: one per engine, whatever the schedulers on it (the
# static steps of the engine's StepCache are shared by prompts of one shape, so two runs at once would share one)
_ONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ONE_GUARD = threading.Lock()


class OwnSteps:
    """A packed slot's on_step and stop hook: a failure of its request's on_step stops that slot at the read (its
    result replaced by the error), as it ends Engine.calibrate alone, and leaves the packed step's other slots, other
    requests', running."""

    def __init__(self, on_step, stop_reason) -> None:
        self.fn, self.stop_reason = on_step, stop_reason
        self.error: BaseException | None = None

    def on_step(self, step: int, f: float) -> None:
        if self.error is None:
            try:
                self.fn(step, f)
            except BaseException as exc:  # noqa: BLE001 - the request's own failure
                self.error = exc

    def should_stop(self) -> str | None:
        return "failed" if self.error is not None else self.stop_reason()


class CalibrationLane:
    """The calibrations and calls in flight on one engine (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        plan = engine.plan
        self.packed = PackedRun(engine.backend, plan.pack, plan.sync_every) if plan.pack > 1 else None
        self.slots: dict[int, object] = {}  # packed index -> owner
        self.own: dict[int, OwnSteps] = {}  # packed index -> its request's on_step, failures kept to itself
        self.running: tuple | None = None  # (owner, Coroutine) of the one-at-a-time calibration
        self.calls: deque[tuple] = deque()  # (owner, Call)
        self.rope: dict[str, tuple] = {}  # 'packed' / 'one' -> the rotary lengths it last ran with
        self.turn = 0  # alternates calls with calibrations
        self.steps = 0  # calibration turns run

    @property
    def busy(self) -> bool:
        return bool(self.slots or self.running or self.calls)

    @property
    def size(self) -> int:
        """Calibrations and calls in flight."""
        return len(self.slots) + (self.running is not None) + len(self.calls)

    def packable(self, item: Calibrate) -> bool:
        """Does the item run as a slot of the packed step (module docstring)?"""
        return (self.packed is not None and self.engine.reuse_mode(item.reuse) == "off"
                and item.config.estimator != "grad")

    def takes(self, item) -> bool:
        """Is there a place for the item now: a call when none is in the lane (they run one a unit; the others wait
        in the queue, counted against max_queue), a calibration in a free slot."""
        if isinstance(item, Call):
            return not self.calls
        if self.packable(item):
            return len(self.slots) < self.packed.pack
        with _ONE_GUARD:  # and none of another thread's runs (Engine.run would refuse it)
            return self.running is None and _ONE.get(self.engine) in (None, self) and not self.engine.calibrating

    def start(self, owner, item, stop_reason) -> None:
        """Begin the work (its first turn comes with the next unit). stop_reason(): the request's own ('cancelled',
        'deadline', 'shutdown' or None), which a calibration checks at each step boundary."""
        if isinstance(item, Call):
            self.calls.append((owner, item))
        elif self.packable(item):
            own = OwnSteps(item.on_step, stop_reason)
            i = self.packed.add(item.prompt, item.config, item.time_budget_s, should_stop=own.should_stop,
                                on_step=own.on_step if item.on_step is not None else None)
            self.slots[i] = owner
            self.own[i] = own
        else:
            with _ONE_GUARD:
                _ONE[self.engine] = self
            self.running = (owner, self._coroutine(item, stop_reason))

    def _coroutine(self, item: Calibrate, stop_reason) -> Coroutine:
        def hook():
            co.pause()  # a step boundary: the engine goes back to the scheduler until the next turn
            return stop_reason()

        co = Coroutine(lambda: self.engine.calibrate(item.prompt, item.config, reuse=item.reuse, should_stop=hook,
                                                     time_budget_s=item.time_budget_s, on_step=item.on_step))
        return co

    def _rope(self, kind: str, run) -> None:
        """run() with the rotary tables `kind` last ran with (module docstring)."""
        m = getattr(self.engine.backend, "model", None)
        restore = getattr(m, "restore_rope", None)
        if restore is not None and kind in self.rope:
            restore(self.rope[kind])
        try:
            run()
        finally:
            if restore is not None:
                self.rope[kind] = m.rope_lengths

    def unit(self) -> list[tuple]:
        """One turn (module docstring) -> [(owner, result | None, error)]."""
        self.turn += 1
        if self.calls and (self.turn % 2 or not (self.slots or self.running)):
            owner, call = self.calls.popleft()
            try:
                return [(owner, call.fn(self.engine), None)]
            except BaseException as exc:  # noqa: BLE001 - the call's own failure (an asyncio.CancelledError too)
                return [(owner, None, exc)]
        done = []
        if self.slots:
            out: list = []
            try:
                self._rope("packed", lambda: out.extend(self.packed.interval()))
            except BaseException as exc:  # noqa: BLE001 - a failure of the packed step fails its slots
                done += [(owner, None, exc) for owner in self.slots.values()]
                self.slots.clear()
                self.own.clear()
                self.packed = PackedRun(self.engine.backend, self.packed.pack, self.packed.sync_every)
            for i, res in out:
                error = self.own.pop(i).error
                done.append((self.slots.pop(i), None if error is not None else res, error))
            self.steps += 1
        if self.running is not None:
            owner, co = self.running
            self._rope("one", co.resume)
            self.steps += 1
            if co.done:
                co.join()
                self.running = None
                with _ONE_GUARD:
                    _ONE.pop(self.engine, None)
                self.rope.pop("one", None)
                done.append((owner, co.result, co.error))
        return done


__all__ = ["CalibrationLane"]
