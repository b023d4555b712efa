"""The calibration store (sicl_fast.store): keys, the memory LRU by bytes, the disk format (round trip bit for bit,
atomic files, checksums, corrupt and truncated entries moved aside and recomputed), single flight across threads
and across two processes sharing a directory. No model: entries are made from tensors."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from sicl_fast.calibration.ascent import CalibrationConfig
from sicl_fast.errors import SiclError, SiclWarning
from sicl_fast.formats.requests import Request
from sicl_fast.formats.spans import Prompt
from sicl_fast.store import Calibration, CalibrationStore, calibration_key
from sicl_fast.store.disk import FORMAT, SIDECAR, sidecar_sha256
from sicl_fast.store.memory import MemoryLRU

pytest.importorskip("safetensors")


def entry(key: str, n: int = 6, d: int = 4, seed: int = 0) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    return Calibration(key=key, scope="stem", rows=torch.randn(n, d, generator=g),
                       input_ids=torch.arange(n, dtype=torch.int64) + seed, token_spans=((2, 4), (5, 6)),
                       demo_start=1, demo_end=n, initial_proxy=0.25, best_proxy=0.5 + 1e-9 * seed, steps=3,
                       best_step=2, gated=False, stop_reason="max_steps", history=[0.25, 0.4, 0.5 + 1e-9 * seed],
                       projections=0, seconds=1.5, config=CalibrationConfig(N=4, seed=seed, scale=0.3), impl="torch",
                       model="m", exact=True, min_cosine=0.97)


def same(a: Calibration, b: Calibration) -> bool:
    return (torch.equal(a.rows, b.rows) and torch.equal(a.input_ids, b.input_ids)
            and a.meta() == b.meta())


def test_memory_lru_counts_bytes_not_entries():
    one = entry("a").nbytes
    lru = MemoryLRU(2 * one + 10)
    for k in "abc":
        lru.put(entry(k))
    assert len(lru) == 2 and "a" not in lru and lru.bytes == 2 * one and lru.evictions == 1
    lru.get("b")  # b is now the most recent: c goes next
    lru.put(entry("d"))
    assert "b" in lru and "d" in lru and "c" not in lru
    big = entry("big", n=400)
    lru.put(big)  # larger than the whole budget: not kept, and the others were dropped making room for it
    assert "big" not in lru and lru.bytes <= lru.max_bytes


def test_memory_lru_recounts_an_entry_whose_kv_grew():
    class KV:
        nbytes = 0

    lru = MemoryLRU(3 * entry("a").nbytes)
    for k in "abc":
        lru.put(entry(k))
    cal = lru.get("a")
    cal.kv = KV()
    cal.kv.nbytes = entry("a").nbytes  # the K/V of a: a's size doubles, so b (the least recent) must go
    lru.touch("a")
    assert "a" in lru and "b" not in lru and lru.bytes == 4 * entry("a").nbytes - entry("a").nbytes
    cal.kv.nbytes = 10 * lru.max_bytes  # K/V alone over the budget: the entry stays, its K/V is dropped
    lru.touch("a")
    assert "a" in lru and cal.kv is None and lru.bytes <= lru.max_bytes


def test_keys_hold_every_input():
    req = Request(id="r", prompt="x" * 20, output_spans=((3, 5),))
    p = Prompt(request=req, input_ids=torch.arange(12), token_spans=((3, 5), (7, 9)), demo_start=1, demo_end=9)
    fp = {"model": "m", "weights": "w"}
    cfg = CalibrationConfig(scale=0.5)
    k = calibration_key(fp, p, cfg, 9, "stem")
    assert k == calibration_key(fp, p, cfg, 9, "stem")
    q = Prompt(request=req, input_ids=torch.cat([torch.arange(9), torch.tensor([99, 98, 97])]),
               token_spans=p.token_spans, demo_start=1, demo_end=9)
    assert calibration_key(fp, q, cfg, 9, "stem") == k  # another query: the same stem key
    others = [calibration_key({**fp, "weights": "v"}, p, cfg, 9, "stem"),
              calibration_key(fp, p, cfg.replace(seed=1), 9, "stem"),
              calibration_key(fp, p, cfg.replace(max_steps=7), 9, "stem"),
              calibration_key(fp, p, cfg, 12, "prompt"),
              calibration_key(fp, Prompt(request=req, input_ids=p.input_ids, token_spans=((3, 5), (6, 9)),
                                         demo_start=1, demo_end=9), cfg, 9, "stem"),
              calibration_key(fp, Prompt(request=req, input_ids=p.input_ids, token_spans=p.token_spans,
                                         demo_start=2, demo_end=9), cfg, 9, "stem")]
    assert len({k, *others}) == 1 + len(others)


def test_disk_round_trip_is_bit_for_bit(tmp_path):
    s = CalibrationStore(1 << 20, tmp_path)
    cal = entry("k" * 40, seed=3)
    s.put(cal)
    fresh = CalibrationStore(1 << 20, tmp_path)  # a new process's view: nothing in memory
    got = fresh.get(cal.key)
    assert got is not None and same(got, cal) and fresh.stats["disk_reads"] == 1
    assert not list(tmp_path.rglob("*.tmp")), "no temporary file left behind"
    side = json.loads(fresh.disk.paths(cal.key)[1].read_text())
    assert side["format"] == FORMAT and side["key"] == cal.key and side["sha256"] == sidecar_sha256(side)


@pytest.mark.parametrize("damage", ["flip", "truncate", "sidecar", "missing_tensors", "meta_edit", "deep_sidecar"])
def test_corrupt_entry_is_moved_aside_and_recomputed(tmp_path, damage):
    key = "c" * 40
    CalibrationStore(1 << 20, tmp_path).put(entry(key))
    s = CalibrationStore(1 << 20, tmp_path)
    tensors, sidecar = s.disk.paths(key)
    if damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[-3] ^= 0x40
        tensors.write_bytes(bytes(data))
    elif damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:-7])
    elif damage == "sidecar":
        sidecar.write_bytes(sidecar.read_bytes()[:40])
    elif damage == "missing_tensors":
        tensors.unlink()
    elif damage == "deep_sidecar":  # issue 54 item 4: the parser's RecursionError was an internal error of every run
        sidecar.write_bytes(b"[" * 100000 + b"]" * 100000)
    else:  # a hand edit of the sidecar that keeps it valid JSON
        side = json.loads(sidecar.read_text())
        side["meta"]["best_proxy"] = 0.99
        sidecar.write_text(json.dumps(side))
    assert_moved_aside_and_recomputed(s, key, tmp_path)


def assert_moved_aside_and_recomputed(s: CalibrationStore, key: str, root: Path, why: str = "") -> None:
    computed = []

    def compute():
        computed.append(1)
        return entry(key, seed=5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal, hit = s.get_or_compute(key, compute)
    assert computed == [1] and not hit and same(cal, entry(key, seed=5))
    said = [str(w.message) for w in caught if issubclass(w.category, SiclWarning)]
    assert any("corrupt" in m and why in m for m in said), said
    assert s.disk.corrupted == 1 and any((root / "corrupt").iterdir())
    again = CalibrationStore(1 << 20, root).get(key)  # the recomputed entry replaced it on disk
    assert same(again, entry(key, seed=5))


@pytest.mark.parametrize("field", list(SIDECAR))
@pytest.mark.parametrize("resealed", [False, True])
def test_a_sidecar_without_a_field_is_moved_aside(tmp_path, field, resealed):
    """Valid JSON lacking a field, as written or resealed with a checksum over what is left (a writer that forgot
    it): reported, moved aside and recomputed, never a KeyError."""
    key = "f" * 40
    CalibrationStore(1 << 20, tmp_path).put(entry(key))
    s = CalibrationStore(1 << 20, tmp_path)
    sidecar = s.disk.paths(key)[1]
    side = json.loads(sidecar.read_text())
    del side[field]
    if resealed and field != "sha256":
        side["sha256"] = sidecar_sha256(side)
    sidecar.write_text(json.dumps(side))
    assert_moved_aside_and_recomputed(s, key, tmp_path, f"lacks {field}")


@pytest.mark.parametrize("change,why", [
    (lambda side: [side], "is a JSON list, not an object"),
    (lambda side: "entry", "is a JSON str, not an object"),
    (lambda side: {**side, "tensors_bytes": str(side["tensors_bytes"])}, "tensors_bytes is of the wrong type"),
    (lambda side: {**side, "tensors_bytes": True}, "tensors_bytes is of the wrong type"),
    (lambda side: {**side, "tensors_sha256": None}, "tensors_sha256 is of the wrong type"),
    (lambda side: {**side, "meta": [side["meta"]], "key": 7}, "key, meta are of the wrong type"),
    (lambda side: {**side, "meta": {**side["meta"], "history": None}}, "the metadata's history is of the wrong type"),
    (lambda side: {**side, "extra": 1}, "unknown fields extra"),
])
def test_a_sidecar_of_the_wrong_shape_is_moved_aside(tmp_path, change, why):
    """Fields of the wrong type, resealed with a matching checksum so that the type check must catch them."""
    key = "w" * 40
    CalibrationStore(1 << 20, tmp_path).put(entry(key))
    s = CalibrationStore(1 << 20, tmp_path)
    sidecar = s.disk.paths(key)[1]
    side = change(json.loads(sidecar.read_text()))
    if isinstance(side, dict):
        side["sha256"] = sidecar_sha256(side)
    sidecar.write_text(json.dumps(side))
    assert_moved_aside_and_recomputed(s, key, tmp_path, why)


def reseal(s: CalibrationStore, key: str, meta: dict) -> None:
    """Give `key`'s sidecar this metadata, resealed with a matching checksum (what a checksum cannot catch)."""
    sidecar = s.disk.paths(key)[1]
    side = json.loads(sidecar.read_text())
    side["meta"] = meta
    side["sha256"] = sidecar_sha256(side)
    sidecar.write_text(json.dumps(side))


def test_the_metadata_is_checked_field_by_field(tmp_path):
    """Issue 54, defects 6 and 7: an entry's metadata must have exactly an entry's fields (entry.META: what
    Calibration.meta writes), each of its JSON type. An extra "kv" (481e2be: AttributeError 'dict' object has no
    attribute 'nbytes' in every later run, the entry kept), stop_reason 42 and impl an object (481e2be: served, and
    both went into the record), and every other field of another type, resealed with a matching checksum, are
    corrupt: reported, moved aside and recomputed, never served."""
    key = "m" * 40
    cases = [({"kv": {"k": [1.0]}}, "the metadata has unknown fields kv"),
             ({"stop_reason": 42, "impl": {"name": "torch"}}, "the metadata's stop_reason, impl are of the wrong type"),
             ({"scope": "everything"}, "the metadata's scope 'everything' is not one of stem, prompt"),
             ({"token_spans": [[2, 4], [5]]}, "the metadata's token_spans are not pairs of token positions"),
             ({"history": [0.25, "0.4", 0.5]}, "the metadata's history holds a value that is not a number")]
    for name, value in entry(key).meta().items():
        odd = {} if isinstance(value, list) else [value]
        cases.append(({name: odd}, f"the metadata's {name} is of the wrong type"))
    cases.append(({"gated": 0}, "the metadata's gated is of the wrong type"))
    cases.append(({"steps": True}, "the metadata's steps is of the wrong type"))
    for i, (change, why) in enumerate(cases):
        root = tmp_path / str(i)
        CalibrationStore(1 << 20, root).put(entry(key))
        s = CalibrationStore(1 << 20, root)
        reseal(s, key, {**entry(key).meta(), **change})
        assert_moved_aside_and_recomputed(s, key, root, why)
    from sicl_fast.store.entry import META

    assert set(META) == set(entry(key).meta())  # the checked fields are the ones written


def test_an_entry_that_cannot_be_moved_aside_is_said_so_once_and_kept(tmp_path):
    """Issue 54, defect 8: corrupt/ replaced by a file after the store opened, so a corrupt entry cannot go there.
    The warning says what was done (not moved, why, left in place), once for a lookup that reads the key twice
    (reuse 'auto': get, then get_or_compute), and the entry is not overwritten by the recomputed one: it stays for
    inspection; a later lookup of this store reads it as missing without a second warning. Once corrupt/ is a
    folder again, a new store (another process) moves it there and stores the recomputed entry. 481e2be said "moved
    to .../corrupt" twice and overwrote it."""
    key = "v" * 40
    CalibrationStore(1 << 20, tmp_path).put(entry(key))
    s = CalibrationStore(1 << 20, tmp_path)
    reseal(s, key, {**entry(key).meta(), "stop_reason": 42})
    files = [p.read_bytes() for p in s.disk.paths(key)]
    (tmp_path / "corrupt").rmdir()
    (tmp_path / "corrupt").write_text("not a folder")

    def lookup(store):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert store.get(key) is None
            cal, hit = store.get_or_compute(key, lambda: entry(key, seed=5))
        assert not hit and same(cal, entry(key, seed=5))
        store.memory = MemoryLRU(1 << 20)  # the next lookup goes to the disk again
        return [str(w.message) for w in caught if issubclass(w.category, SiclWarning)]

    said = lookup(s)
    assert len(said) == 1 and "is corrupt (the metadata's stop_reason is of the wrong type); could not be moved to " \
        f"{tmp_path / 'corrupt'} (Not a directory): left in place for inspection" in said[0], said
    assert "moved to" not in said[0].replace("could not be moved to", "")
    assert [p.read_bytes() for p in s.disk.paths(key)] == files  # kept, not overwritten
    assert lookup(s) == [] and [p.read_bytes() for p in s.disk.paths(key)] == files
    (tmp_path / "corrupt").unlink()
    said = lookup(CalibrationStore(1 << 20, tmp_path))
    assert len(said) == 1 and f"moved to {tmp_path / 'corrupt'} and recomputed" in said[0], said
    assert sorted(p.read_bytes() for p in (tmp_path / "corrupt").iterdir()) == sorted(files)
    assert same(CalibrationStore(1 << 20, tmp_path).get(key), entry(key, seed=5))


def test_single_flight_across_threads(tmp_path):
    for directory in (None, tmp_path):
        s = CalibrationStore(1 << 20, directory)
        calls, started = [], threading.Event()

        def compute():
            calls.append(1)
            started.set()
            time.sleep(0.3)
            return entry("t" * 40)

        out = []
        threads = [threading.Thread(target=lambda: out.append(s.get_or_compute("t" * 40, compute)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(calls) == 1 and len(out) == 4
        assert sorted(hit for _, hit in out) == [False, True, True, True]
        assert all(same(cal, out[0][0]) for cal, _ in out)


def test_a_leader_that_keeps_nothing_lets_a_waiter_compute():
    """compute() returning None (a run stopped by its deadline) stores nothing: a waiter then computes its own."""
    s = CalibrationStore(1 << 20)
    calls = []

    def compute():
        calls.append(1)
        time.sleep(0.2)
        return None if len(calls) == 1 else entry("n" * 40)

    out = []
    threads = [threading.Thread(target=lambda: out.append(s.get_or_compute("n" * 40, compute))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(calls) == 2 and sorted(c is None for c, _ in out) == [False, True]


def leader_holding(hold) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds a key (hold(release): in flight, or its disk lock) until the returned event is set."""
    release, holding = threading.Event(), threading.Event()

    def run():
        hold(lambda: (holding.set(), release.wait(60)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert holding.wait(30)
    return t, release


@pytest.mark.parametrize("held", ["flight", "lock"])
def test_a_waiter_whose_should_stop_fires_stops_waiting(tmp_path, held):
    """A caller waiting for another's compute of its key (in flight in this process, or computing under the disk
    lock in another store on the directory, as another process would) looks at its should_stop while it waits: when
    it fires, the caller runs its own compute at once (a calibration whose hook fired runs one step and ends with
    the hook's reason), while the other still holds the key; nothing of it reaches the disk."""
    key = "s" * 40
    s = CalibrationStore(1 << 20, tmp_path)
    if held == "flight":
        leader, release = leader_holding(lambda block: s.flight.run(key, block))
    else:
        other = CalibrationStore(1 << 20, tmp_path)  # its own flight table: only the flock is shared
        leader, release = leader_holding(lambda block: other.get_or_compute(key, lambda: block() and None))
    try:
        looks, out = [], []
        should_stop = lambda: looks.append(1) or ("deadline" if len(looks) >= 3 else None)  # noqa: E731
        waiter = threading.Thread(target=lambda: out.append(s.get_or_compute(key, lambda: None, should_stop)))
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive() and leader.is_alive(), "the waiter waited for the leader"
        assert out == [(None, False)] and len(looks) == 3 and s.stats["gave_up"] == 1
        got = s.get(key, lambda: "deadline")  # a lookup gives up the same way: nothing found
        assert got is None and (held == "flight" or s.stats["gave_up"] == 2)
    finally:
        release.set()
        leader.join(30)
    assert not s.disk.paths(key)[1].exists()


CHILD = r"""
import sys, time
sys.path.insert(0, {tests!r})
from test_store import entry
from sicl_fast.store import CalibrationStore
marks = sys.argv[2]

def mark(word):
    with open(marks, "a") as fh:
        fh.write(word + "\n")

def seen(word):
    with open(marks) as fh:
        return word in fh.read().split()

def compute():
    mark("computed")
    t = time.monotonic()
    while not seen("waiting") and time.monotonic() - t < 60:  # until the other process waits for this key
        time.sleep(0.02)
    return entry("p" * 40, seed=7)

def should_stop():  # looked at only while this process waits for the other's lock
    if not seen("waiting"):
        mark("waiting")
    return None

s = CalibrationStore(1 << 20, sys.argv[1])
cal, hit = s.get_or_compute("p" * 40, compute, should_stop)
print(hit, float(cal.rows.sum()))
"""


def test_two_processes_share_a_directory_and_compute_once(tmp_path):
    """Two processes ask for one key at once. The one that computes goes on only once the other has said that it
    waits for the key's lock (its should_stop is looked at only while it waits), so the two overlap for certain:
    without the lock both would compute (each waiting in vain for the other to wait)."""
    marks = tmp_path / "marks.txt"
    marks.write_text("")
    code = CHILD.format(tests=str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "store"), str(marks)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    words = marks.read_text().split()
    assert words.count("computed") == 1 and "waiting" in words, words
    hits = sorted(o.split()[0] for o, _ in outs)
    assert hits == ["False", "True"] and len({o.split()[1] for o, _ in outs}) == 1
    assert same(CalibrationStore(1 << 20, tmp_path / "store").get("p" * 40), entry("p" * 40, seed=7))


def test_bad_store_arguments(tmp_path):
    with pytest.raises(SiclError, match="max_bytes"):
        CalibrationStore(-1)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SiclError, match=f"store {f / 'sub'}: {f} is not a directory"):
        CalibrationStore(1, f / "sub")


def test_a_store_folder_that_cannot_be_one_says_what_it_is(tmp_path):
    """#40: a store on a dangling link said only "cannot create it: File exists" (--export and --report name the
    link); now the same check as theirs, also for a sub-folder that is a file."""
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(SiclError, match=r"store .*dangling: is a symbolic link to .*gone, which does not exist"):
        CalibrationStore(1, tmp_path / "dangling")
    for empty in ("", " "):  # the current folder would fill with entries/, locks/ and corrupt/
        with pytest.raises(SiclError, match="store: an empty folder name; give a folder"):
            CalibrationStore(1, empty)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "entries").write_text("x")
    with pytest.raises(SiclError, match=r"store .*s/entries: is a file; give a folder"):
        CalibrationStore(1, tmp_path / "s")


def test_a_killed_writers_temporaries_are_removed(tmp_path):
    """#40: kill -9 during a store write left entries/<xx>/<key>.safetensors.*.tmp or <key>.json.*.tmp for ever.
    A store that opens removes those of every key no one holds; a read of a key removes that key's."""
    import fcntl

    first = CalibrationStore(1 << 20, tmp_path)
    cal = entry("a" * 40)
    first.put(cal)
    tensors, sidecar = first.disk.paths(cal.key)
    held_key = "b" * 40
    left = [tensors.with_name(tensors.name + ".x1.tmp"), sidecar.with_name(sidecar.name + ".x2.tmp")]
    held = first.disk.paths(held_key)[0]
    held.parent.mkdir(parents=True, exist_ok=True)
    held = held.with_name(held.name + ".x3.tmp")  # a live writer's: its key's lock is held
    for p in (*left, held):
        p.write_bytes(b"half")
    with open(tmp_path / "locks" / f"{held_key}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        CalibrationStore(1 << 20, tmp_path)  # a new process opening the store
        assert not any(p.exists() for p in left) and held.exists()
    left[0].write_bytes(b"half")
    fresh = CalibrationStore(1 << 20, tmp_path)
    left[0].write_bytes(b"half")  # killed after this store opened: its next read of the key removes it
    assert same(fresh.get(cal.key), cal) and not left[0].exists()


def test_a_shard_folder_that_is_a_file_costs_only_the_disk_copy(tmp_path, caplog):
    """entries/<k[:2]> replaced by a file: the entry is kept in memory, the disk write is logged as failed and
    nothing is raised (before: FileExistsError from its mkdir, an internal error of the run)."""
    key = "s" * 40
    s = CalibrationStore(1 << 20, tmp_path)
    (tmp_path / "entries").mkdir()  # the store makes its folders with its first lookup
    (tmp_path / "entries" / key[:2]).write_text("not a folder")
    with caplog.at_level("WARNING", logger="sicl_fast.store"):
        s.put(entry(key))
    assert same(s.get(key), entry(key)) and f"cannot write entry {key}" in caplog.text
