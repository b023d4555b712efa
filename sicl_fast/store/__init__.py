"""The calibration store: calibrations kept by content and reused (README "Calibrate once, answer many").

    store = CalibrationStore(max_bytes=1 << 30, directory=None)    memory LRU; with a directory also on disk
    cal, hit = store.get_or_compute(key, compute, should_stop)     compute() -> Calibration | None, run once per
                                                                   key across threads (and processes sharing the
                                                                   directory); None: nothing to keep
    store.get(key, should_stop, expect) / store.put(cal, should_stop) / store.peek(key)   (peek: memory only)

Lookups go memory, then disk (an entry read from disk is kept in memory). should_stop (optional) is the caller's
calibration hook (sicl_fast.run.run_args.stop_check: its deadline, cancellation, time budget): a caller waiting for
another's work (single flight, another process's lock) looks at it every few hundredths of a second and stops
waiting when it fires (get_or_compute says what happens then). expect (optional, entry.Expected) is what the lookup
expects its entry to be (its prompt's token ids and rows, the model's width): an entry read from disk that is not
that is corrupt, moved aside and recomputed, never served. See entry.py (the stored object), keys.py (what a
key holds), memory.py, disk.py (format, atomic writes, checksums, locking), flight.py, wait.py.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

from ..errors import SiclError
from .disk import DiskStore
from .entry import Calibration, Expected
from .flight import SingleFlight
from .keys import calibration_key, engine_fingerprint
from .memory import MemoryLRU
from .wait import GaveUp

StopHook = Callable[[], str | None] | None  # a calibration's should_stop (sicl_fast.run.run_args)

DEFAULT_MAX_BYTES = 1 << 30


class CalibrationStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, directory: str | os.PathLike | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise SiclError(f"store: max_bytes must be an int >= 0, got {max_bytes!r}")
        self.memory = MemoryLRU(max_bytes)
        self.disk = DiskStore(directory) if directory is not None else None
        self.flight = SingleFlight()
        self._count_lock = threading.Lock()
        # gave_up: waits for another's work ended by the waiter's should_stop
        self.stats = {"hits": 0, "misses": 0, "computed": 0, "disk_reads": 0, "gave_up": 0}

    def _count(self, name: str) -> None:
        with self._count_lock:
            self.stats[name] += 1

    def get(self, key: str, should_stop: StopHook = None, expect: Expected | None = None) -> Calibration | None:
        """The entry for key from memory or disk, or None (also when should_stop fired while another process held
        the key's lock: the caller goes on as on a miss). expect: what the lookup expects the entry to be
        (entry.Expected), checked on what the disk serves (an entry in memory was checked, or computed, here)."""
        cal = self.memory.get(key)
        if cal is None and self.disk is not None:
            try:
                with self.disk.lock(key, should_stop):
                    cal = self.disk.read(key, expect)
            except GaveUp:
                self._count("gave_up")
                return None
            if cal is not None:
                self._count("disk_reads")
                self.memory.put(cal)
        return cal

    def peek(self, key: str, exact: bool = False) -> Calibration | None:
        """The entry for key when memory holds it (and it is exact, with `exact`), counted as a hit; else None. No
        disk read and no wait."""
        cal = self.memory.get(key)
        if cal is None or (exact and not cal.exact):
            return None
        self._count("hits")
        return cal

    def put(self, cal: Calibration, should_stop: StopHook = None) -> None:
        """Keep an entry in memory and on disk (only in memory when should_stop fired while another process held
        the key's lock)."""
        self.memory.put(cal)
        if self.disk is not None:
            try:
                with self.disk.lock(cal.key, should_stop):
                    self.disk.write(cal)
            except GaveUp:
                self._count("gave_up")

    def touch(self, cal: Calibration) -> None:
        """Re-count an entry whose K/V was attached (the memory budget covers it)."""
        self.memory.touch(cal.key)

    def get_or_compute(self, key: str, compute: Callable[[], Calibration | None], should_stop: StopHook = None,
                       expect: Expected | None = None) -> tuple[Calibration | None, bool]:
        """(entry, hit). On a miss compute() runs once for the key; threads asking meanwhile wait for it, and so
        do processes sharing the directory (its lock is held while computing). compute() returning None (nothing
        to keep: a run stopped early, a query-dependent result) leaves no entry: a waiter then looks again and
        computes its own. Returns (the computed entry or None, False) to the caller that computed.

        should_stop: the caller's calibration hook, which compute() must honour too. When it fires while this
        caller waits for another's compute (single flight, or another process's lock), the caller stops waiting
        and runs compute() itself at once, outside the single flight and the lock: a calibration whose hook has
        fired runs up to the first check (one step; the static loop's first read) and ends with the hook's reason
        (as a time budget of 0 does), so the caller gets what its own calibration would have given by then, and
        nothing is written to disk (a run stopped from outside is not kept). expect: as get's."""
        while True:
            cal = self.memory.get(key)
            if cal is not None:
                self._count("hits")
                return cal, True
            try:
                got, led = self.flight.run(key, lambda: self._lead(key, compute, should_stop, expect), should_stop)
            except GaveUp:
                self._count("gave_up")
                cal = compute()
                if cal is not None:  # a run that ended on its own first (the gate, max_steps): complete, kept
                    self.memory.put(cal)
                return cal, False
            if led:
                cal, fresh = got
                self._count("computed" if fresh else "hits")
                return cal, not fresh
            if got is not None and got[0] is not None:  # a waiter on a leader that made (or read) the entry
                self._count("hits")
                return got[0], True
            # the leader kept nothing or failed: look again, and lead a call of our own if still missing

    def _lead(self, key: str, compute, should_stop: StopHook, expect: Expected | None = None
              ) -> tuple[Calibration | None, bool]:
        """(entry, computed here). Under the disk lock when there is a disk: another process may have written it
        meanwhile, or may be computing it (then this waits and reads, or gives up: GaveUp)."""
        if self.disk is None:
            return self._compute(compute), True
        with self.disk.lock(key, should_stop):
            cal = self.disk.read(key, expect)
            if cal is not None:
                self._count("disk_reads")
                self.memory.put(cal)
                return cal, False
            cal = self._compute(compute)
            if cal is not None:
                self.disk.write(cal)
            return cal, True

    def _compute(self, compute) -> Calibration | None:
        self._count("misses")
        cal = compute()
        if cal is not None:
            self.memory.put(cal)
        return cal


__all__ = ["CalibrationStore", "Calibration", "Expected", "calibration_key", "engine_fingerprint", "DEFAULT_MAX_BYTES"]
