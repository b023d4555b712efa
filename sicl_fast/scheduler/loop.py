"""Scheduler: one thread that owns the engine and runs it in iterations, as vLLM's scheduler does.

    sched = Scheduler(engine, Limits(...))          (Engine.scheduler() makes the engine's own)
    t = sched.answer(calibration, query)            a Ticket; t.result() / await t -> Generation
    t = sched.calibrate(prompt, max_steps=20)       -> CalibrationResult
    t = sched.submit(flow, kind, deadline)          any flow of work (scheduler.tickets, scheduler.work)
    sched.drain(stop_at) / sched.close()

Each iteration: takes the new requests and starts their flows (a calibration the store's memory already holds is
answered at once: Engine.stored_result); drops what was cancelled; admits waiting work in arrival order within the
limits (scheduler.limits: answer rows, their K/V tokens, bytes; calibration slots); refuses new requests beyond
max_queue waiting (QueueFull); then runs one unit of one lane:

    answers       a read interval (a token on the CPU) of every answer in flight, batched per prefix K/V
                  (scheduler.answers): rows join at the next token and leave at their stop
    calibrations  a step (or read interval) of the calibration in flight, a read interval of the packed step, or
                  a call (scheduler.calibrations)

The lanes share the engine's time by weight (SHARES: two thirds to the answers while both have work): the one whose
clock (its seconds on the engine over its weight) is behind runs next, and a lane that gets work starts level with
the other (no credit builds up while it is idle). So an answer that arrives during a calibration takes about one
and a half times its time alone plus the calibration step in progress (a step is not cut), and a stream of answers
slows a calibration to a third of its speed, never more: it ends. Within a lane, admission is in arrival order;
work that does not fit the rows or tokens waits with its lane, and the oldest work that does not fit the bytes
holds back all younger work until it fits (so nothing starves), but for younger answers while it waits for bytes
that calibrations hold (they may run long; the answers end soon, and then it holds them back too). A unit runs under
the engine's lock (`engine_lock`), so two schedulers on one engine (two servers in one process) take turns.

Cancellation (Ticket.cancel: a client that went away), a deadline and the drain act on their own request only: a
waiting request leaves the queue; an answer leaves its batch at the next token; a calibration stops at its next step
boundary with the best X so far (stop_reason 'deadline' / 'shutdown'; a cancelled one's result is dropped).
"""
from __future__ import annotations

import atexit
import bisect
import dataclasses
import inspect
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any

from ..answering.answer import checked_queries
from ..errors import LimitError
from ..run.memory import cache_budget
from .answers import AnswerLane
from .calibrations import CalibrationLane
from .limits import Cost, Limits, over_limit
from .tickets import Cancelled, QueueFull, ShuttingDown, Ticket
from .work import WORK, Answer, Calibrate, Call

log = logging.getLogger("sicl_fast.scheduler")

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
IDLE_POLL_S = 0.05  # how often an idle loop with work it cannot admit looks again
EXIT_WAIT_S = 30.0  # at the interpreter's exit, how long a scheduler left running has to stop its work
# each lane's share of the engine's time while both have work: answers are short and someone waits for each token
# (an answer during a calibration: about 1.5x its time alone plus the step in progress); a calibration still
# gets a third, so a stream of answers never stops it
SHARES = {"answers": 2.0, "work": 1.0}


def engine_lock(engine) -> threading.RLock:
    """The lock every scheduler on `engine` runs its units under."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(engine)
        if lock is None:
            lock = _LOCKS[engine] = threading.RLock()
        return lock


def _close_at_exit(ref) -> None:
    """At the interpreter's exit: close a scheduler left running (Scheduler.ended says why it must end first)."""
    sched = ref()
    if sched is not None and not sched.ended:
        sched.close(EXIT_WAIT_S)


class Observer:
    """What a front end may hear of the scheduler (the server's metrics implement it)."""

    def decoded(self, rows: int, tokens: int, seconds: float) -> None:
        """A unit of the answers lane: rows in its batches, tokens it decoded, its seconds."""

    def finished(self, ticket: Ticket) -> None:
        """An admitted request ended (its queue and batch seconds are final)."""


class _Open:
    """A request in the scheduler: the items of its current yield and their results."""

    __slots__ = ("ticket", "items", "results", "left", "error", "many")

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self.items: list = []
        self.results: list = []
        self.left = 0
        self.error: BaseException | None = None
        self.many = False


class Scheduler:
    """Module docstring. observer: an Observer (metrics); name: the thread's."""

    def __init__(self, engine, limits: Limits | None = None, observer: Observer | None = None,
                 name: str = "sicl-fast-scheduler") -> None:
        self.engine = engine
        self.limits = limits or Limits()
        self.max_bytes = self.limits.max_bytes or cache_budget(engine.lm.device)
        self.observer = observer or Observer()
        self.answers = AnswerLane(engine)
        self.work = CalibrationLane(engine)
        self.every = getattr(engine.backend, "read_every", 1)
        self._cond = threading.Condition(threading.RLock())
        self._inbox: list[Ticket] = []
        self._open: dict[Ticket, _Open] = {}
        self._owner: dict[Any, tuple[_Open, int, Cost]] = {}  # an item in flight -> its request, index, cost
        self._pending: list[tuple[int, int, Any]] = []  # (request seq, item id, item) waiting for a place
        self._waiting: dict[Ticket, None] = {}  # requests never admitted, in arrival order
        self._seq = 0
        self.used = Cost()
        self.used_work = Cost()  # of which the calibrations' and calls' (the work lane's)
        self.vtime = {"answers": 0.0, "work": 0.0}
        self._busy_before = {"answers": False, "work": False}
        self._mean_s = 1.0  # running mean of a request's time in the batch (Retry-After)
        self._draining = self._closed = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------------------------------ front ends

    def submit(self, flow: Generator, kind: str = "request", deadline: float | None = None) -> Ticket:
        """Queue a flow (scheduler.tickets); ShuttingDown while draining. A request that cannot be admitted while
        max_queue others wait ends with QueueFull (its ticket's exception). A flow is a generator not yet started
        (the scheduler sends it its first None): anything else is a TypeError here, before it is queued."""
        ticket = Ticket(flow, kind, deadline)
        with self._cond:  # read where the scheduler starts flows (_main): a flow submitted twice is seen here
            what = self._not_new(flow)
            if what is not None:
                raise TypeError(f"Scheduler.submit: a flow is a generator not yet started (it yields scheduler.work "
                                f"items: scheduler.tickets), got {what}")
            if self._draining:
                raise ShuttingDown()
            self._seq += 1
            ticket.seq = self._seq
            self._inbox.append(ticket)
            self._waiting[ticket] = None
            self._cond.notify()
        return ticket

    def _not_new(self, flow) -> str | None:
        """What `flow` is when it is not a generator the scheduler may start (a new one, not queued already)."""
        if not inspect.isgenerator(flow):
            return type(flow).__name__
        if inspect.getgeneratorstate(flow) != inspect.GEN_CREATED:
            return "a generator already " + inspect.getgeneratorstate(flow).removeprefix("GEN_").lower()
        if any(t.flow is flow for t in self._inbox):
            return "a generator already submitted"
        return None

    def check(self) -> None:
        """Raise ShuttingDown while draining, QueueFull when max_queue requests already wait (before a request is
        read: the server's 429 at once; submit decides again)."""
        with self._cond:
            if self._draining:
                raise ShuttingDown()
            if len(self._waiting) >= max(1, self.limits.max_queue):
                raise self._full()

    def _full(self) -> QueueFull:
        waiting = len(self._waiting)
        retry = max(1, math.ceil(self._mean_s * (waiting + 1) / max(1, len(self._open) - waiting)))
        return QueueFull(waiting, self.limits.max_queue, retry)

    def calibrate(self, prompt, config=None, reuse: str | None = None, time_budget_s: float | None = None,
                  deadline: float | None = None, on_step=None, **overrides) -> Ticket:
        """Engine.calibrate through the scheduler (its steps interleaved with every other request's work)."""
        cfg = self.engine.config(config, **overrides)

        def flow():
            return (yield Calibrate(prompt, cfg, reuse, time_budget_s, on_step))
        return self.submit(flow(), "calibrate", deadline)

    def answer(self, calibration, query, max_new_tokens: int = 32, stop_strings=("\n",),
               on_text: Callable[[str], Any] | None = None) -> Ticket:
        """Engine.answer through the scheduler: the query's row joins the running batch of its calibration. Checked
        here, before it is queued, as Engine.answer checks (answering.answer.checked_queries)."""
        cal, stops, (prompt,) = checked_queries(self.engine, calibration, [query], max_new_tokens, stop_strings)

        def flow():
            return (yield Answer(prompt, max_new_tokens, stops, on_text, calibration=cal))
        return self.submit(flow(), "answer")

    def call(self, fn: Callable[[Any], Any], kind: str = "call") -> Ticket:
        """fn(engine) on the scheduler's thread, as one unit."""
        def flow():
            return (yield Call(fn))
        return self.submit(flow(), kind)

    # ------------------------------------------------------------------------------------------ state

    @property
    def depth(self) -> int:
        """Requests waiting to be admitted."""
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not ended."""
        with self._cond:
            return len(self._open) - sum(1 for t in self._open if t in self._waiting)

    @property
    def busy(self) -> bool:
        """Is any work in flight (or on the engine: a cancelled calibration finishing its step)?"""
        return self.in_flight > 0 or self.answers.busy or self.work.busy

    @property
    def batch_rows(self) -> int:
        """Answers decoding now."""
        return self.answers.size

    def drain(self, stop_at: float) -> int:
        """Take no new requests; end the waiting ones with ShuttingDown; requests in flight go on (answers to their
        stop; calibrations until stop_at, a time.monotonic() value, when their stop_reason() becomes 'shutdown').
        -> the number of requests ended."""
        with self._cond:
            self._draining = True
            waiting = list(self._waiting)
            for t in self._open:
                if t not in self._waiting:
                    t.shutdown_at = stop_at
            for t in waiting:
                self._end(t, error=ShuttingDown())
            self._cond.notify()
        return len(waiting)

    def close(self, timeout: float = 30.0) -> bool:
        """Drain, cancel what is in flight (a calibration stops at its next step boundary) and join the thread for
        at most timeout s. -> whether it has ended (`ended`)."""
        self.drain(time.monotonic())
        with self._cond:
            self._closed = True
            for t in list(self._open):
                t.cancel()
            self._cond.notify()
        self._thread.join(timeout)
        return self.ended

    @property
    def ended(self) -> bool:
        """The thread has returned. A process must not finalize while it runs: a thread that has run torch code and
        takes the GIL back during the interpreter's finalization is ended inside torch's C++ frames, which aborts the
        process ('terminate called without an active exception'; pytorch/pytorch#38228)."""
        return not self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------------------------------ flows

    def _advance(self, op: _Open, value: Any = None, error: BaseException | None = None) -> None:
        """Send the flow its last result (or error) and queue what it yields next, or end the request."""
        t = op.ticket
        try:
            got = t.flow.throw(error) if error is not None else t.flow.send(value)
        except StopIteration as stop:
            self._end(t, stop.value)
            return
        except BaseException as exc:  # noqa: BLE001 - the request's own failure
            self._end(t, error=exc)
            return
        op.many = isinstance(got, (list, tuple))
        op.items = list(got) if op.many else [got]
        odd = next((item for item in op.items if not isinstance(item, WORK)), None)
        if odd is not None:  # its own failure: an item the lanes cannot run (nor key, if unhashable) stops here
            op.items = []
            self._end(t, error=TypeError(f"request {t.kind!r}: its flow yielded {type(odd).__name__} {odd!r:.60}; a "
                                         "flow yields scheduler.work items (Calibrate, Answer, Call) or a list of "
                                         "them"))
            return
        # the scheduler keys work in flight by the item object: one yielded again (the same Answer twice in a list,
        # or one that another request has in flight) runs as a copy of its own
        op.items = [dataclasses.replace(item) if item in self._owner or any(item is x for x in op.items[:k]) else item
                    for k, item in enumerate(op.items)]
        op.results, op.left, op.error = [None] * len(op.items), len(op.items), None
        if not op.items:
            self._advance(op, [])
            return
        for i, item in enumerate(op.items):
            self._queue(op, i, item)

    def _queue(self, op: _Open, i: int, item) -> None:
        """An item of a request: answered at once when the store holds its calibration, else priced and waiting."""
        t = op.ticket
        try:
            if isinstance(item, Calibrate):
                res = self.engine.stored_result(item.prompt, item.config, reuse=item.reuse)
                if res is not None:
                    self._owner[item] = (op, i, Cost())
                    self._done(item, res)
                    return
            cost = self.refuse_alone(item)
        except BaseException as exc:  # noqa: BLE001 - the request's own failure
            self._owner[item] = (op, i, Cost())
            self._done(item, error=exc)
            return
        self._owner[item] = (op, i, cost)
        bisect.insort(self._pending, (t.seq, id(item), item))

    def refuse_alone(self, item, least: bool = False) -> Cost:
        """The item's cost; LimitError when it exceeds a limit by itself (it could never be admitted). Checked as the
        item is queued, and by a front end before it queues a request whose later work it knows (a chat's answer,
        which comes after its calibration). least: an Answer priced as the least it may hold, its calibration not
        known yet (one stored over its whole prompt, a per-query calibration's: its new tokens only), so that a check
        made early refuses nothing the queue takes."""
        cost = self._cost(item, least)
        why = cost.fits(Cost(), self.limits, self.max_bytes)
        if why is not None:
            raise LimitError(f"request {item.prompt.id!r}: {over_limit(why, cost, self.limits, self.max_bytes)}")
        return cost

    def _cost(self, item, least: bool = False) -> Cost:
        lm, plan = self.engine.lm, self.engine.plan
        if isinstance(item, Answer):
            if least:
                return Cost.of_answer(lm, item.prompt, item.max_new_tokens, item.prompt.length, self.every, False)
            n = item.calibration.length if item.calibration is not None else item.prompt.demo_end
            return Cost.of_answer(lm, item.prompt, item.max_new_tokens, n, self.every, item.calibration is None)
        if isinstance(item, Calibrate):
            return Cost.of_calibration(lm, plan, item.prompt, item.config, self.work.packable(item))
        return Cost()

    def _done(self, item, result: Any = None, error: BaseException | None = None) -> None:
        """An item ended: its place is free; its request goes on once every item of its yield has."""
        op, i, cost = self._owner.pop(item)
        self.used = self.used - cost
        if not isinstance(item, Answer):
            self.used_work = self.used_work - cost
        if op.ticket.done:
            return
        if op.ticket.cancelled:  # whatever its work gave (a calibration stopped with reason 'cancelled')
            self._end(op.ticket, error=Cancelled())
            return
        op.results[i] = result
        op.error = op.error or error
        op.left -= 1
        if op.left == 0:
            self._advance(op, op.results if op.many else op.results[0], op.error)

    def _end(self, t: Ticket, result: Any = None, error: BaseException | None = None) -> None:
        """End a request: its waiting items go, its answers leave their batches (a calibration of it stops at its
        next step boundary, its result dropped then)."""
        op = self._open.pop(t, None)
        admitted = t.admitted is not None
        self._waiting.pop(t, None)
        if op is not None:
            for item in op.items:
                if item not in self._owner or self._owner[item][0] is not op:
                    continue
                if self._is_waiting(item):
                    self._owner.pop(item)
                elif isinstance(item, Answer):
                    self.answers.drop(item)
                    self.used = self.used - self._owner.pop(item)[2]
            self._pending = [p for p in self._pending if p[2] in self._owner]
        t.end(result, error)
        if admitted:
            self._mean_s = 0.8 * self._mean_s + 0.2 * t.batch_seconds
            try:
                self.observer.finished(t)
            except BaseException:  # noqa: BLE001 - the observer's failure is no request's
                log.exception("the scheduler's observer failed")

    def _is_waiting(self, item) -> bool:
        return any(p[2] is item for p in self._pending)

    # ------------------------------------------------------------------------------------------ iterations

    def _main(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._open or self._lanes_busy()) and not self._closed:
                    self._cond.wait()
                if self._closed and not (self._inbox or self._open or self._lanes_busy()):
                    return
                new, self._inbox = self._inbox, []
                for t in new:
                    op = self._open[t] = _Open(t)
                    self._advance(op)
                self._reap()
                self._admit()
                self._refuse()
            if not self._run_unit():
                with self._cond:  # work waits that nothing running will free: look again soon
                    self._cond.wait(IDLE_POLL_S)

    def _lanes_busy(self) -> bool:
        return self.answers.busy or self.work.busy

    def _reap(self) -> None:
        """Cancelled requests end now (module docstring)."""
        for t in [t for t in self._open if t.cancelled]:
            self._end(t, error=Cancelled())

    def _lane(self, item) -> str:
        if isinstance(item, Answer):
            return "answers"
        if isinstance(item, Call):
            return "call"
        return "packed" if self.work.packable(item) else "one"

    def _admit(self) -> None:
        """Waiting items into their lanes, in arrival order (module docstring)."""
        blocked: set[str] = set()
        for entry in list(self._pending):
            item = entry[2]
            op, _, cost = self._owner[item]
            lane = self._lane(item)
            if lane in blocked:
                continue
            if lane != "answers" and not self.work.takes(item):
                blocked.add(lane)
                continue
            why = cost.fits(self.used, self.limits, self.max_bytes)
            if why == "bytes" and lane != "answers" and cost.fits(self.used_work, self.limits, self.max_bytes):
                blocked.update(("packed", "one", "call"))  # it waits for bytes a calibration holds: younger work
                continue  # waits behind it, younger answers go on (a long calibration never holds answers back)
            if why == "bytes":
                break  # the oldest that does not fit holds back everything younger (what it waits for ends soon)
            if why is not None:
                blocked.add(lane)
                continue
            self._pending.remove(entry)
            t = op.ticket
            if t.admitted is None:
                t.admitted = time.monotonic()
                self._waiting.pop(t, None)
                t.decide()
            self.used = self.used + cost
            if lane != "answers":
                self.used_work = self.used_work + cost
            try:
                if lane == "answers":
                    self.answers.start(item, item)
                else:
                    self.work.start(item, item, t.stop_reason)
            except BaseException as exc:  # noqa: BLE001 - the item's own failure (bad input found late)
                self._done(item, error=exc)

    def _refuse(self) -> None:
        """Requests beyond max_queue waiting end with QueueFull (the oldest keep their places)."""
        extra = list(self._waiting)[self.limits.max_queue:]
        if extra:
            full = self._full()
            for t in extra:
                self._end(t, error=full)

    def _run_unit(self) -> bool:
        """One unit of the lane that has had less of the engine (module docstring); -> whether one ran."""
        busy = {"answers": self.answers.busy, "work": self.work.busy}
        for name, other in (("answers", "work"), ("work", "answers")):
            if busy[name] and not self._busy_before[name]:  # it starts level: no credit for its idle time, nor
                self.vtime[name] = max(self.vtime[name], self.vtime[other])  # the other's lead from its own
        self._busy_before = busy
        lanes = [n for n in ("answers", "work") if busy[n]]
        if not lanes:
            return False
        name = min(lanes, key=lambda n: self.vtime[n])
        t0 = time.perf_counter()
        with engine_lock(self.engine):
            if name == "answers":
                tokens = self.answers.tokens
                done, rows = self.answers.unit()
            else:
                done = self.work.unit()
        seconds = time.perf_counter() - t0
        self.vtime[name] += seconds / SHARES[name]
        if name == "answers":
            try:
                self.observer.decoded(rows, self.answers.tokens - tokens, seconds)
            except BaseException:  # noqa: BLE001 - the observer's failure is no request's
                log.exception("the scheduler's observer failed")
        with self._cond:
            for item, result, error in done:
                if item in self._owner:
                    self._done(item, result, error)
        return True


__all__ = ["Scheduler", "Observer", "engine_lock", "Limits"]
