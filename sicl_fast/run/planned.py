"""What a run would write, known before its model loads: the engine's part of its records' settings (the model, the
run plan's axes: sicl_fast.run.settings) and the model's name, family and size (its calibration preset), so that a
resume is checked before any weight is read (a finished run ends, one of other settings is refused, without the
model).

    early = planned(model, dtype, device, choices)    a Planned, or None where it cannot be told before the load
    early.settings, early.name, early.family, early.n_params
    early.plan                                        the RunPlan made before the load: the engine's, handed on
                                                      (Engine(plan=...), run.plan.confirm_plan); None when recalled
    remember(key, facts)                              after the load: what the engine planned (run.workers'
                                                      engine_facts), recalled by the next run of the same key

Two ways to know it:
  * planned: the model's architecture on the meta device (its config and modules, no weights:
    sicl_fast.models.facts.unloaded) and the run plan made on it, as the engine makes it (make_plan, whose warnings
    are said here: it is the run's plan). This imports transformers, whose configuration classes load its modeling
    code: 2-3 s on a CPU, which a run that loads its model pays anyway but a finished or refused resume does not
    need (bench/RESULTS.md section 33).
  * recalled: what an engine of the same arguments planned after its load, kept in the model cache
    (models.converted.plans_dir()/KEY.json, the newest KEEP; `sicl-fast cache list` counts them, `cache clear`
    removes them) under a key of everything that plan is made from (plan_key): the model's files (their fingerprint:
    not their name or path), the arguments (dtype, device, the choices), this machine (the device it resolves, the
    GPU's name and capability, the cores this process may use), the software (every file of sicl_fast and its
    kernels by size and time, the versions of torch, transformers, triton and flash-attn) and the environment
    variables a plan may read (threads, OpenMP, Triton, torch, CUDA). Nothing of transformers is imported on this
    path. A key whose plan was never remembered (the first run after an edit or an upgrade, another machine, a model
    never loaded with these arguments) is planned. A recalled plan that the engine would no longer make (something
    the key does not hold has changed) answers a resume as that plan would; a run that loads checks its records again
    with what its engine planned (the results writer's check) and remembers that plan in its place.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import SiclError
from ..formats.inputs import json_value, of_type
from .plan import RunPlan, make_plan
from .settings import model_plan_settings

VERSION = 1  # of what a remembered plan holds and of its key
KEEP = 64  # remembered plans kept, the newest
# the environment variables a plan may read, as the user sets them (not those torch sets for itself once imported,
# TORCHINDUCTOR_CACHE_DIR); the key is taken before the engine is built, which sets none of these
ENV_PREFIXES = ("SICL_", "OMP_", "GOMP_", "KMP_", "MKL_", "TRITON_", "TORCH_", "PYTORCH_", "CUDA_", "NVIDIA_")


@dataclass(frozen=True)
class Planned:
    """What a run of given arguments would write (module docstring)."""

    settings: dict  # the engine's part of the records' settings (sicl_fast.run.settings.engine_settings)
    name: str  # the model's name, as load() gives it
    family: str  # its config's model_type and parameter count: its calibration preset (CalibrationConfig.preset)
    n_params: int
    plan: RunPlan | None = None  # made on the architecture before the load (None: recalled)
    key: str | None = None  # what it is remembered by (plan_key; None: it cannot be)


def planned(model, dtype: str, device: str, choices) -> Planned | None:
    """A Planned for an Engine of these arguments (module docstring): recalled where an engine of the same key
    remembered its plan, else planned on the model's architecture. None where the model cannot be read without
    loading it (the run loads it and says what is wrong). A plan refused here is refused as the load would refuse it
    (SiclError)."""
    from ..models.facts import transformers_attention, unloaded

    key, identity = plan_key(model, dtype, device, choices)
    got = recall(key)
    if got is not None:
        return Planned({"model": identity, **got["settings"]}, identity["name"], got["family"], got["n_params"],
                       key=key)
    try:
        lm = unloaded(model, dtype, device)
    except Exception:  # noqa: BLE001 - cannot tell without loading: the run loads it and reports what is wrong
        return None
    try:
        plan = make_plan(lm, choices)
        attention = plan.attention if plan.kind.cls == "fast" else transformers_attention(lm)  # as the backend's
        return Planned(model_plan_settings(lm, plan, attention), lm.name, lm.family,
                       sum(p.numel() for p in lm.model.parameters()), plan, key)
    except SiclError:
        raise
    except Exception:  # noqa: BLE001 - as above
        return None


def plan_key(model, dtype: str, device: str, choices) -> tuple[str | None, dict | None]:
    """(the key a plan of these arguments is remembered by, the model's identity as records name it:
    models.facts.model_identity), from everything the plan is made from (module docstring); (None, None) where the
    model or the device cannot be told here (planned then plans, or the run loads and says why)."""
    import torch

    from ..models.facts import files_fingerprint
    from ..models.loading import resolve, resolve_device

    try:
        name, path, _ = resolve(model)
        fingerprint = files_fingerprint(path)
        dev, _ = resolve_device(device)
    except Exception:  # noqa: BLE001 - not known here: planned() plans, and the load says what is wrong
        return None, None
    machine = {"device": str(dev), "cpus": len(os.sched_getaffinity(0))}
    if dev.type == "cuda":
        machine["gpu"] = [torch.cuda.get_device_name(dev), list(torch.cuda.get_device_capability(dev))]
    made_from = {"version": VERSION, "fingerprint": fingerprint, "dtype": str(dtype), "device": str(device),
                 "choices": dataclasses.asdict(choices), "machine": machine, "software": software(),
                 "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}}
    text = json.dumps(made_from, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], {"name": name, "fingerprint": fingerprint}


@functools.cache
def software() -> dict:
    """The software a plan is made by: every file of sicl_fast and of its kernels (path, size, modification time: an
    edit of a checkout, a rebuilt extension, changes it) and the versions of torch, transformers, triton and
    flash-attn. Once a process."""
    roots = [Path(__file__).resolve().parents[1]]
    spec = importlib.util.find_spec("sicl_fast.kernels")  # installed beside the package, or mapped to kernels/
    roots += [Path(p).resolve() for p in (spec.submodule_search_locations or ()) if spec is not None]
    h = hashlib.sha256()
    for root in dict.fromkeys(roots):
        for folder, subs, files in os.walk(root):
            subs[:] = sorted(d for d in subs if d != "__pycache__")
            for f in sorted(files):
                st = os.stat(os.path.join(folder, f))
                h.update(f"{os.path.relpath(os.path.join(folder, f), root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    versions = {}
    for dist in ("torch", "transformers", "triton", "flash_attn"):  # flash-attn: an attention kernel 'auto' takes
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {"files": h.hexdigest(), **versions}


def _folder() -> Path:
    from ..models.converted import plans_dir

    return plans_dir()


def recall(key: str | None) -> dict | None:
    """What remember() kept under `key` ({"settings", "family", "n_params"}), or None: never remembered, or
    unreadable (then planned)."""
    if key is None:
        return None
    path = _folder() / f"{key}.json"
    try:
        got = json_value(path.read_bytes(), str(path))
    except (OSError, SiclError):  # SiclError: not JSON, not UTF-8, nested too deep for the parser
        return None
    ok = (isinstance(got, dict) and got.get("version") == VERSION and _settings_ok(got.get("settings"))
          and isinstance(got.get("family"), str) and got["family"] != "" and _count(got.get("n_params")))
    return got if ok else None


# what a remembered plan's settings hold (run.settings.plan_settings of a plan made before any run, so no fallback),
# each a JSON type of its own: anything else is a damaged file, planned again rather than answering a resume with it
PLANNED = {"backend": (str,), "impl": (str,), "attention": (str, type(None)), "diff_matmul": (str,), "dtype": (str,),
           "device": (str,), "length_buckets": (int, type(None)), "pack": (int,), "fallback": (type(None),)}
PLANNED_OPTIONAL = {"attention_precision": (str,)}  # present only where not IEEE float32 (RunPlan.result_axes)


def _count(x) -> bool:
    """An int >= 1 that is not a bool."""
    return of_type(x, int) and x >= 1


def _settings_ok(settings) -> bool:
    """Are `settings` what remember() keeps (PLANNED, PLANNED_OPTIONAL), each of its type?"""
    types = {**PLANNED, **PLANNED_OPTIONAL}
    if not isinstance(settings, dict) or not PLANNED.keys() <= settings.keys() <= types.keys():
        return False
    return (all(of_type(v, types[k]) for k, v in settings.items())
            and _count(settings["pack"]) and (settings["length_buckets"] is None or _count(settings["length_buckets"])))


def remember(key: str | None, facts: dict) -> None:
    """Keep what an engine planned after its load under `key` (plan_key of the arguments it was built from):
    `facts` as run.workers.engine_facts gives them (its settings, its model's family and parameter count). The
    model's identity is not kept (the key holds its fingerprint; its name is the one the next run names it by). A
    cache that cannot be written costs the next run its planning, nothing else (as sources.json's digests)."""
    if key is None:
        return
    settings = {k: v for k, v in facts["settings"].items() if k != "model"}
    entry = {"version": VERSION, "settings": settings, "family": facts["family"], "n_params": facts["n_params"]}
    folder = _folder()
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, sort_keys=True), encoding="utf-8")
        os.replace(tmp, folder / f"{key}.json")  # readers see the whole entry or none
    except OSError:
        with contextlib.suppress(OSError):  # plans/ a file, a read-only cache: nothing was written
            tmp.unlink(missing_ok=True)
        return
    for old in _newest_first(folder)[KEEP:]:
        with contextlib.suppress(OSError):  # removed meanwhile by another process, or not ours to remove
            old.unlink(missing_ok=True)


def _newest_first(folder: Path) -> list[Path]:
    """The remembered plans in `folder` (files only: a folder of that name is not one), the newest first (one removed
    meanwhile by another process is left out)."""
    found = []
    for path in folder.glob("*.json"):
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime_ns, path))
    return [path for _, path in sorted(found, reverse=True)]


__all__ = ["Planned", "planned", "plan_key", "software", "recall", "remember", "VERSION", "KEEP"]
