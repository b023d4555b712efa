"""The converted-model cache (sicl_fast.models.converted), on tiny GGUF files written here: keyed by content, checked on
load, a damaged entry moved aside with one warning and rebuilt (plausible floats, NaN bytes, a truncated file, a
broken config.json, a lost manifest), two real processes converting at once, and `sicl-fast cache`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from sicl_fast import Engine, load
from sicl_fast.commands.cli import main
from sicl_fast.errors import SiclWarning
from sicl_fast.models import converted as cache
from sicl_fast.models.loading import converted_path
from tiny_gguf import write_tiny_gguf

pytest.importorskip("gguf")

REQ = {"id": "q", "demos": [{"input": "hello", "output": "world"}, {"input": "he", "output": "wor"}],
       "query": "hello"}


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SICL_FAST_CACHE", str(root))
    return root


@pytest.fixture
def gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf", weights=True)[0]


def proxy_of(lm) -> float:
    eng = Engine(lm)
    return float(eng.proxy(eng.prepare(REQ)).f[0])


def load_quietly(path):
    """load(path) and the SiclWarnings it gave."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        lm = load(path)
    return lm, [str(w.message) for w in got if issubclass(w.category, SiclWarning)]


def leftovers(root) -> list[str]:
    """Temporary folders and files of conversions still in the cache."""
    return [p.name for p in (root / "converted").iterdir() if p.name.startswith(".tmp-")]


def test_entry_is_keyed_by_content_and_checked(cache_root, gguf, tmp_path, monkeypatch):
    lm, warned = load_quietly(gguf)
    assert warned == []
    entry = converted_path(gguf)
    assert entry is not None and (entry / cache.MANIFEST).is_file() and leftovers(cache_root) == []
    man = json.loads((entry / cache.MANIFEST).read_text())
    assert {"config.json", "model.safetensors"} <= set(man["files"]) and man["source"]["name"] == "tiny.gguf"
    # a copy under another name, elsewhere, with another mtime (another checkout or virtual environment): the same
    # entry, no conversion
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    os.utime(copy, (1e9, 1e9))

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr("sicl_fast.models.loading._convert_gguf", no_conversion)
    assert proxy_of(load(copy)) == proxy_of(lm)
    assert converted_path(copy) == entry and len(list((cache_root / "converted").glob("*-*"))) == 1
    # the source's hash is remembered against its path, size and mtime: not computed again
    monkeypatch.setattr(cache, "file_sha256", no_conversion)
    assert cache.content_key(gguf) == cache.content_key(copy)


def _floats(entry, count, value=None) -> bytes:
    """`count` float32 values as bytes: plausible random weights, or `value`."""
    if value is None:
        return (np.random.default_rng(7).standard_normal(count) * 0.2).astype(np.float32).tobytes()
    return np.full(count, value, dtype=np.float32).tobytes()


def _overwrite_tail(path, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[-len(data):] = data  # the last tensor's values (the file keeps its size)
    path.write_bytes(bytes(raw))


DAMAGES = {
    "plausible floats": lambda e: _overwrite_tail(e / "model.safetensors", _floats(e, 512)),
    "NaN bytes": lambda e: _overwrite_tail(e / "model.safetensors", _floats(e, 512, np.nan)),
    "truncated weights": lambda e: os.truncate(e / "model.safetensors", (e / "model.safetensors").stat().st_size // 2),
    "broken config.json": lambda e: (e / "config.json").write_text("{"),
    "manifest lost": lambda e: (e / cache.MANIFEST).unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_moved_aside_and_rebuilt(cache_root, gguf, damage):
    good = proxy_of(load(gguf))
    entry = converted_path(gguf)
    DAMAGES[damage](entry)
    assert converted_path(gguf) is None  # the load-time check sees it
    lm, warned = load_quietly(gguf)
    assert len(warned) == 1 and str(entry) in warned[0] and "moved it to" in warned[0], warned
    assert proxy_of(lm) == good  # the rebuilt entry, not the damaged one
    assert converted_path(gguf) == entry and cache.verify(entry, full=True) is None
    assert len(list((cache_root / "converted" / ".bad").iterdir())) == 1 and leftovers(cache_root) == []
    assert proxy_of(load(gguf)) == good  # and later loads use it without a word
    assert load_quietly(gguf)[1] == []


def test_a_damaged_entry_that_cannot_be_moved_aside_is_said_so_and_kept(cache_root, gguf, capsys):
    """Issue 54, item 4 (the store's defect 8 in the model cache): converted/.bad replaced by a file, so a damaged
    entry cannot go there. A load says so in one warning (not "moved it to"), converts without caching and leaves
    the entry in place (481e2be: a raw FileExistsError on every load); `cache verify` reports it damaged and left in
    place (exit 1; 481e2be: the same traceback), and `cache path` refuses to hand it over in one line."""
    good = proxy_of(load(gguf))
    entry = converted_path(gguf)
    DAMAGES["broken config.json"](entry)
    (cache_root / "converted" / ".bad").write_text("not a folder")
    for _ in range(2):
        lm, warned = load_quietly(gguf)
        assert len(warned) == 1 and f"{entry} has a config.json of 1 bytes" in warned[0] and (
            f"could not move it to {cache_root / 'converted' / '.bad'} (File exists): it stays in place, and "
            "tiny.gguf is converted again without caching it") in warned[0], warned
        assert proxy_of(lm) == good and (entry / "config.json").read_text() == "{"
    capsys.readouterr()
    assert main(["cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert f"damaged  {entry}: has a config.json of 1 bytes" in out and "(File exists): it stays in place" in out
    assert main(["cache", "path", str(gguf)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the converted folder {entry} has a config.json" in err and "remove it" in err, err


def _sampled_sparsely(monkeypatch) -> None:
    """Make the load-time file check sample the tiny model's weights as it samples a real model's (files of
    FULL_BELOW bytes or more): most bytes fall between the samples."""
    for name, value in (("FULL_BELOW", 0), ("SAMPLE_HEAD", 64), ("SAMPLE_BLOCK", 16), ("SAMPLE_STRIDE", 4096)):
        monkeypatch.setattr(cache, name, value)


def _write_between_samples(path, tensor: str, value: float) -> None:
    """Overwrite one float32 of `tensor` in a safetensors file, at a place the sample digest does not read."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start, end = (8 + n + o for o in json.loads(raw[8:8 + n])[tensor]["data_offsets"])

    def sampled(o):
        return o < cache.SAMPLE_HEAD or o >= len(raw) - cache.SAMPLE_HEAD \
            or (o - cache.SAMPLE_HEAD) % cache.SAMPLE_STRIDE < cache.SAMPLE_BLOCK

    at = next(o for o in range(start, end, 4) if not any(sampled(o + i) for i in range(4)))
    raw[at:at + 4] = np.float32(value).tobytes()
    path.write_bytes(bytes(raw))


def test_a_few_bytes_changed_in_a_tensor_are_found_on_every_load(cache_root, gguf, monkeypatch):
    """A plausible float written over one weight of a small tensor, between the file check's samples: the tensor
    sums of the load see it, the entry is moved aside and rebuilt (before: it loaded silently, with other results;
    only `sicl-fast cache verify` found it)."""
    _sampled_sparsely(monkeypatch)
    good = proxy_of(load(gguf))
    entry = converted_path(gguf)
    _write_between_samples(entry / "model.safetensors", "model.layers.0.input_layernorm.weight", 3.0)
    assert converted_path(gguf) == entry  # the file check alone misses it
    lm, warned = load_quietly(gguf)
    assert len(warned) == 1 and "model.layers.0.input_layernorm.weight" in warned[0], warned
    assert "checksum mismatch" in warned[0] and "moved it to" in warned[0]
    assert proxy_of(lm) == good and cache.verify(entry, full=True) is None
    assert load_quietly(gguf)[1] == []


def test_cache_path_checks_every_byte_of_the_folder_it_hands_over(cache_root, gguf, monkeypatch, capsys):
    """`sicl-fast cache path` hands the folder to stacks that load it without our tensor sums, so it checks every
    byte: a float changed between the load's samples is found, the entry moved aside and converted again (before:
    the damaged folder was printed)."""
    _sampled_sparsely(monkeypatch)
    load(gguf)
    entry = converted_path(gguf)
    _write_between_samples(entry / "model.safetensors", "model.layers.0.input_layernorm.weight", 3.0)
    assert converted_path(gguf) == entry  # the sampled check alone misses it
    assert main(["cache", "path", str(gguf)]) == 0
    out, err = capsys.readouterr()
    warned = [line for line in err.splitlines() if line.startswith("sicl-fast: warning:")]
    assert len(warned) == 1 and "checksum mismatch" in warned[0] and "moved it to" in warned[0], err
    assert out.strip() == str(entry)  # converted again into the same place
    assert cache.verify(entry, full=True) is None


@pytest.mark.parametrize("damaged", [False, True])
def test_an_entry_without_tensor_sums_is_checked_in_full_once(cache_root, gguf, monkeypatch, damaged):
    """An entry written before the tensor sums still loads: every byte is checked against its sha256 once and the
    sums are added to its manifest (a damaged one is moved aside and rebuilt)."""
    _sampled_sparsely(monkeypatch)
    good = proxy_of(load(gguf))
    entry = converted_path(gguf)
    man = json.loads((entry / cache.MANIFEST).read_text())
    sums = man.pop("tensors")
    assert "model.embed_tokens.weight" in sums
    (entry / cache.MANIFEST).write_text(json.dumps(man))
    if damaged:
        _write_between_samples(entry / "model.safetensors", "model.layers.0.post_attention_layernorm.weight", 3.0)
    lm, warned = load_quietly(gguf)
    assert proxy_of(lm) == good
    if damaged:
        assert len(warned) == 1 and "checksum mismatch" in warned[0] and "moved it to" in warned[0], warned
    else:
        assert warned == []
    assert json.loads((entry / cache.MANIFEST).read_text())["tensors"] == sums
    assert load_quietly(gguf)[1] == []


def test_tensor_sums_see_any_change_and_swaps():
    """One bit changed anywhere changes the sums (the first byte, a middle one, the last, in the tail of odd
    sizes), and so do two different bytes swapped; two int64 words swapped keep the plain sum and change the
    position-weighted one."""
    rng = np.random.default_rng(1)
    for shape, dtype in (((3000, 7), torch.float32), ((5,), torch.bfloat16), ((9,), torch.bool)):
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
        t = x > 0 if dtype == torch.bool else x.to(dtype)
        raw = t.reshape(-1).view(torch.uint8)
        base = cache.tensor_sums(raw)
        assert cache.tensor_sums(t) == base and cache.tensor_sums(t.clone()) == base
        for at in (0, raw.numel() // 2, raw.numel() - 1):
            changed = raw.clone()
            changed[at] ^= 1
            assert cache.tensor_sums(changed) != base, at
        j = int(torch.nonzero(raw != raw[0])[-1, 0])  # the last byte that differs from the first
        swapped = raw.clone()
        swapped[0], swapped[j] = raw[j], raw[0]
        assert cache.tensor_sums(swapped) != base
    words = torch.from_numpy(rng.standard_normal(4100)).view(torch.int64)  # two words swapped: the same plain sum
    swapped = words.clone()
    swapped[3], swapped[4000] = words[4000], words[3]
    assert cache.tensor_sums(swapped)[0] == cache.tensor_sums(words)[0]
    assert cache.tensor_sums(swapped)[1] != cache.tensor_sums(words)[1]


def test_the_load_check_samples_large_files_and_verify_reads_every_byte(tmp_path, monkeypatch):
    """A file of FULL_BELOW bytes or more is checked on load by sampling: any damage SAMPLE_STRIDE bytes long (or
    a change of size) is found; a one-byte change between samples only by the full check."""
    for name, value in (("FULL_BELOW", 0), ("SAMPLE_HEAD", 4096), ("SAMPLE_BLOCK", 1024), ("SAMPLE_STRIDE", 16384)):
        monkeypatch.setattr(cache, name, value)
    f = tmp_path / "w.bin"
    data = np.random.default_rng(0).bytes(1 << 20)
    f.write_bytes(data)
    sample, full = cache.sample_digest(f), cache.file_sha256(f)
    assert sample.startswith("sample:")
    block = bytearray(data)
    block[500_000:500_000 + 16384] = bytes(16384)
    f.write_bytes(bytes(block))
    assert cache.sample_digest(f) != sample
    one = bytearray(data)
    one[4096 + 16384 * 10 + 2000] ^= 0xFF  # between two sampled blocks
    f.write_bytes(bytes(one))
    assert cache.sample_digest(f) == sample and cache.file_sha256(f) != full


def test_two_processes_converting_at_once(cache_root, gguf):
    """Both start on an empty cache; one converts, the other waits for the lock and uses the winner's entry; no
    temporary folder is left (before: the loser's rename failed silently and left its copy behind)."""
    code = textwrap.dedent(f"""
        import time, sys
        from sicl_fast.models import loading
        real = loading._convert_gguf
        def slow(path):
            print("converted", flush=True)
            time.sleep(1.5)  # both processes are inside load() meanwhile
            return real(path)
        loading._convert_gguf = slow
        from sicl_fast import Engine, load
        eng = Engine(load({str(gguf)!r}))
        print("entry", loading.converted_path(loading.Path({str(gguf)!r})))
        print("proxy", float(eng.proxy(eng.prepare({REQ!r})).f[0]))
    """)
    env = {**os.environ, "SICL_FAST_CACHE": str(cache_root), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    lines = [out.splitlines() for out, _ in outs]
    assert sum("converted" in ls for ls in lines) == 1, lines  # exactly one conversion
    assert len({tuple(ls[-2:]) for ls in lines}) == 1  # the same entry and the same proxy
    assert leftovers(cache_root) == [] and len(list((cache_root / "converted").glob("*-*"))) == 1


def test_a_killed_conversion_leaves_nothing_behind(cache_root, gguf):
    key = cache.content_key(gguf)
    stale = cache_root / "converted" / f".tmp-{key}-x1y2"  # what a SIGKILL during a conversion leaves
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    load(gguf)
    assert leftovers(cache_root) == [] and converted_path(gguf) is not None


def test_a_cache_that_cannot_be_written_costs_only_speed(tmp_path, gguf, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("SICL_FAST_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: never creatable
    lm, warned = load_quietly(gguf)
    assert len(warned) == 1 and "cannot write to" in warned[0] and "without caching" in warned[0]
    assert lm.hidden_size == 16


def test_cache_command(cache_root, gguf, tmp_path, capsys):
    assert main(["cache", "path", str(gguf)]) == 0  # converts first
    folder = capsys.readouterr().out.strip()
    assert folder == str(converted_path(gguf))
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(folder).config.hidden_size == 16  # an ordinary transformers folder
    assert main(["cache", "path", folder]) == 0  # a model folder is its own
    assert capsys.readouterr().out.strip() == folder
    legacy = cache_root / "converted" / "old-0123456789abcdef"  # made by an older version: no manifest
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "converted" in out and "tiny.gguf" in out and folder in out and "no manifest" in out
    assert main(["cache", "verify"]) == 0
    out = capsys.readouterr().out
    assert f"ok       {folder}" in out and "unused" in out
    DAMAGES["plausible floats"](converted_path(gguf))
    assert main(["cache", "verify", str(gguf), "--quick"]) == 1
    out = capsys.readouterr().out
    assert "damaged" in out and "checksum mismatch" in out and "moved to" in out
    assert cache.find_entry(cache.content_key(gguf)) is None
    assert main(["cache", "verify", str(gguf)]) == 2  # nothing left to verify
    assert "no cache entry yet" in capsys.readouterr().err
    assert main(["cache", "path", str(gguf)]) == 0 and capsys.readouterr().out.strip() == folder  # rebuilt
    items = cache.entries()
    assert {e.state for e in items} == {"converted", "no manifest", "moved aside"}
    assert main(["cache", "clear"]) == 0
    assert f"removed {len(items)} item(s)" in capsys.readouterr().out
    assert cache.entries() == [] and not (cache_root / cache.SOURCES).exists()


# ------------------------------------------------------------------------------------------------ #40: what is ours


def _user_files(folder) -> dict:
    """A user's own files in a folder the cache is pointed at (a converted/ folder and a sources.json of theirs, a
    GGUF of their own, a folder named like an old entry's move aside): `cache clear` must leave every one."""
    files = {folder / "converted" / "mystuff" / "notes.txt": "precious", folder / cache.SOURCES: "mine",
             folder / "own.gguf": "weights", folder / "converted" / ".bad" / "keep" / "x.txt": "x",
             folder / "converted" / "link-0123456789abcdef": None}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            path.symlink_to(folder / "converted" / "mystuff")  # a link is never an entry: the cache makes none
        else:
            path.write_text(text)
    return files


def test_an_empty_or_blank_cache_variable_means_unset(tmp_path, monkeypatch, capsys):
    """#40: SICL_FAST_CACHE= made the cache the current folder: `cache clear` deleted the user's converted/ and
    sources.json there, and `cache path` converted into ./converted and printed a relative path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    files = _user_files(tmp_path)
    for value in ("", "  "):
        monkeypatch.setenv("SICL_FAST_CACHE", value)
        assert cache.cache_dir() == tmp_path / "home" / ".cache" / "sicl_fast"
        assert main(["cache", "clear"]) == 0
        assert f"from {tmp_path / 'home' / '.cache' / 'sicl_fast'}" in capsys.readouterr().out
    monkeypatch.setenv("SICL_FAST_CACHE", "rel")
    assert cache.cache_dir() == tmp_path / "rel" and cache.cache_dir().is_absolute()
    assert all((p.read_text() if p.is_file() else p.is_symlink()) for p in files)


def test_cache_clear_removes_only_what_the_cache_wrote(tmp_path, monkeypatch, capsys):
    """#40: `cache clear` removed every folder in converted/, every *.gguf and sources.json of the folder it was
    pointed at; now only what the cache writes, by its names (and sources.json by its content)."""
    monkeypatch.setenv("SICL_FAST_CACHE", str(tmp_path))
    files = _user_files(tmp_path)
    conv = tmp_path / "converted"
    ours = [conv / "old-0123456789abcdef", conv / ".tmp-0123456789abcdef-x1y2",
            conv / ".bad" / "m-0123456789abcdef-20260101-120000-42",
            tmp_path / cache.ASSEMBLED["gemma3-270m"], tmp_path / f".{cache.ASSEMBLED['gemma3-270m']}.ab12.part"]
    for p in ours:
        if p.suffix in (".gguf", ".part"):
            p.write_bytes(b"GGUF")
        else:
            p.mkdir(parents=True)
            (p / "config.json").write_text("{}")
    (tmp_path / "sources.json").unlink()
    cache._write_json_atomic(tmp_path / cache.SOURCES, {"/x.gguf": {"size": 1, "mtime_ns": 2, "sha256": "ab"}})
    assert sorted(e.path for e in cache.entries()) == sorted(ours)
    assert main(["cache", "clear"]) == 0
    assert f"removed {len(ours)} item(s)" in capsys.readouterr().out
    assert not any(p.exists() for p in ours) and not (tmp_path / cache.SOURCES).exists()
    (tmp_path / cache.SOURCES).write_text("mine")  # not the cache's memo: kept
    assert main(["cache", "clear"]) == 0 and "removed 0 item(s)" in capsys.readouterr().out
    assert all((p.read_text() if p.is_file() else p.is_symlink()) for p in files)


def test_cache_list_and_clear_see_the_remembered_run_plans(tmp_path, monkeypatch, capsys):
    """The run plans resumes recall (sicl_fast.run.planned, plans/<key>.json) are the cache's too: `cache list`
    counts them on one line and `cache clear` removes them (before: neither saw them, and a cleared cache still
    answered resumes from them); a file of the user's in plans/ is kept, with the folder."""
    from sicl_fast.run.planned import recall, remember

    monkeypatch.setenv("SICL_FAST_CACHE", str(tmp_path))
    settings = {"backend": "fast", "impl": "cpp", "attention": None, "diff_matmul": "off", "dtype": "float32",
                "device": "cpu", "length_buckets": None, "pack": 1, "fallback": None}
    keys = ["0123456789abcdef", "fedcba9876543210"]
    for key in keys:
        remember(key, {"settings": settings, "family": "llama", "n_params": 10})
    assert recall(keys[0]) is not None
    mine = cache.plans_dir() / "notes.json"
    mine.write_text("mine")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "# " in out and ": 2 item(s)" in out and "2 remembered run plan(s)" in out and "notes" not in out
    assert main(["cache", "clear"]) == 0 and "removed 2 item(s)" in capsys.readouterr().out
    assert recall(keys[0]) is None and mine.read_text() == "mine"
    mine.unlink()
    remember(keys[0], {"settings": settings, "family": "llama", "n_params": 10})
    assert main(["cache", "clear"]) == 0 and not cache.plans_dir().exists()


def test_an_assembly_removes_a_killed_assemblys_temporary(cache_root):
    """A killed gemma3-270m assembly left its .part (270 MB) in the cache for ever; the next assembly (under the
    file's lock) removes it, and `cache clear` leaves one that is being written alone."""
    name = cache.ASSEMBLED["gemma3-270m"]
    cache_root.mkdir()
    stale = cache_root / f".{name}.k1ll.part"
    stale.write_bytes(b"half")
    with cache.assembling(name) as locked:
        assert locked and not stale.exists()
        stale.write_bytes(b"being written")
        removed, _, skipped = cache.clear()
        assert skipped == [stale] and removed == [] and stale.exists()


@pytest.mark.parametrize("where", ["a file", "a dangling link", "converted is a file"])
def test_cache_commands_on_a_cache_that_is_not_a_folder(tmp_path, monkeypatch, capsys, where):
    """#40: `cache clear` on a file was an internal NotADirectoryError; `cache list` / `verify` said "0 item(s)" /
    "no converted models", exit 0, for a file, a dangling link or a converted/ that is a file."""
    root = tmp_path / "c"
    if where == "a file":
        root.write_text("x")
    elif where == "a dangling link":
        root.symlink_to(tmp_path / "gone")
    else:
        root.mkdir()
        (root / "converted").write_text("x")
    monkeypatch.setenv("SICL_FAST_CACHE", str(root))
    needle = "is a symbolic link to" if where == "a dangling link" else "is a file, not a folder"
    for action in ("list", "verify", "clear", "path"):
        assert main(["cache", action]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "model cache " in err and "(from SICL_FAST_CACHE)" in err and needle in err, err
    assert root.is_symlink() or root.is_file() or (root / "converted").read_text() == "x"


def test_a_sources_memo_nested_too_deep_is_remade_not_a_traceback(tmp_path, monkeypatch):
    # issue 54 item 4: json's RecursionError (not a ValueError) escaped _read_json: every load was an internal error
    monkeypatch.setenv("SICL_FAST_CACHE", str(tmp_path))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF model bytes")
    (tmp_path / cache.SOURCES).write_bytes(b"[" * 100000 + b"]" * 100000)
    assert cache.source_digest(src) == cache.file_sha256(src)
    assert json.loads((tmp_path / cache.SOURCES).read_text())[str(src.resolve())]["sha256"] == cache.file_sha256(src)
