"""MemoryLRU: calibrations kept in memory, bounded in bytes (not entries), least recently used dropped first.

An entry's size (`Calibration.nbytes`) grows when its K/V is attached; `touch(key)` re-counts it and evicts what
no longer fits (an entry whose K/V alone would overflow the budget keeps its rows and drops its K/V, which is
recomputed when next needed). An entry larger than the whole budget is not kept. Thread-safe.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from .entry import Calibration


class MemoryLRU:
    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Calibration] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> Calibration | None:
        with self._lock:
            cal = self._items.get(key)
            if cal is not None:
                self._items.move_to_end(key)
            return cal

    def put(self, cal: Calibration) -> None:
        with self._lock:
            self._drop(cal.key)
            self._items[cal.key] = cal
            self._sizes[cal.key] = size = cal.nbytes
            self.bytes += size
            self._evict()

    def touch(self, key: str) -> None:
        """Re-count an entry whose size changed (its K/V attached or dropped), then evict the least recently used
        down to the budget."""
        with self._lock:
            cal = self._items.get(key)
            if cal is None:
                return
            if cal.nbytes > self.max_bytes and cal.kv is not None:
                cal.kv = None
            self.bytes += cal.nbytes - self._sizes[key]
            self._sizes[key] = cal.nbytes
            self._items.move_to_end(key)
            self._evict()

    def _drop(self, key: str) -> None:
        if key in self._items:
            del self._items[key]
            self.bytes -= self._sizes.pop(key)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._items:
            self._drop(next(iter(self._items)))
            self.evictions += 1


__all__ = ["MemoryLRU"]
