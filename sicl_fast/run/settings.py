"""What a record was made with: the settings that change its numbers, and the one rule that compares them.

Every record of `calibrate`, `icleval` and `gradstudy` carries its run's settings under "settings":

    {"format": 1, "command": "calibrate",
     "model": {"name": "smollm2-135m", "fingerprint": "file:..."},      models.facts.model_identity
     "dtype": "float32", "device": "cpu", "backend": "fast", "impl": "cpp", "attention": "cpp",
     "diff_matmul": "off", "length_buckets": null, "pack": 1,           the run plan's axes (engine_settings), and
     "fallback": null,                                                  what a failed capture check fell back to
     "config": {...},              the CalibrationConfig as asked (the model's preset with the knobs given; scale
                                   null: the model's embedding scale, which the fingerprint fixes)
     ...}                          the command's own: calibrate's time budget, special tokens and outputs
                                   (--generate, --max-new-tokens, --stop, --export); icleval's time budget and
                                   --answer-at; gradstudy's grid

Left out, as they do not change what a record holds: the thread count (it moves a CPU run's last bits, which the
calibration store's keys hold, but a resume on a machine with other cores, or a Ray pool, is the same run), the
loop, sync_every and CUDA graphs (the same bits: tests/test_static.py; a fallback from a captured step that failed
its check is noted, "fallback", and never compared: NOTES), reuse (auto and off give the same bits, and
a record reused under 'on' says exact: false itself), the store, gradstudy's --chunk (memory).

`settings_diff` is the one comparison: every resume (`check_resume`, through the results writer) and `report` (which
splits a file into runs by their settings) use it. It compares what a record was made with, not what it calls it:
the model by its files' fingerprint, not by its name (the embedded model named by its short name or by its own
GGUF path, a model folder or a link to it, are the same files and the same numbers). A record without settings
(written before records carried them, or by hand) has settings unknown (`record_settings` is None): never resumed
with, never pooled with others.

One resume rule for every command: `check_resume` compares each record's settings with this run's and refuses in
one message naming what differs. icleval's records of one run differ by variant (an ablation's config, a baseline's
options, derived from the run's config and flags): their variant's part is compared under the same rule and the
same message (`check_resume`'s `variant`).

What a run would write is known before its model loads: sicl_fast.run.planned.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from ..errors import SiclError

FORMAT = 1
FIELD = "settings"  # where a record holds them


# what a record notes of how it ran without being a reason to refuse another's: a fallback after a failed check of a
# captured step (RunPlan.fallback; an 'uncaptured' one gives the same bits, and a 'torch' one says so in its impl)
NOTES = ("fallback",)


def plan_settings(plan, attention: str | None = None) -> dict:
    """The run plan's axes that change a record's numbers: RunPlan.result_axes (the weights' dtype, the device type,
    backend, impl, the attention kernel that runs, the difference products, the length buckets) without the thread
    count (module docstring), and the pack; and the plan's fallback (a note: NOTES)."""
    axes = plan.result_axes(attention)
    axes.pop("threads", None)
    axes.setdefault("length_buckets", None)
    axes["dtype"] = axes["dtype"].replace("torch.", "")
    return {**axes, "pack": plan.pack, "fallback": plan.fallback}


def model_plan_settings(lm, plan, attention: str | None = None) -> dict:
    """The model (models.facts.model_identity) and plan_settings: an engine's part of a record's settings."""
    from ..models.facts import model_identity

    return {"model": model_identity(lm), **plan_settings(plan, attention)}


def engine_settings(engine) -> dict:
    """An Engine's part of a record's settings (model_plan_settings of its model, plan and the attention kernel its
    backend runs)."""
    return model_plan_settings(engine.lm, engine.plan, engine.backend.attention_kernel)


def fallback_settings(engine) -> dict:
    """What a record adds to its run's settings (the results writer puts its "settings" on top of the run's): after
    a fallback (RunPlan.fallback: a captured step failed its check, and the run went on otherwise) the engine's part
    as it runs now, its impl and attention and the note; {} before any."""
    return {} if engine.plan.fallback is None else {FIELD: engine_settings(engine)}


def run_settings(command: str, engine: dict, config=None, **parts) -> dict:
    """A record's settings (module docstring): the command, the engine's part (engine_settings), the config (a
    CalibrationConfig, or None where the run calibrates nothing) and the command's own parts, JSON-ready and as they
    read back from a results file."""
    out = {"format": FORMAT, "command": command, **engine,
           "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config, **parts}
    return json.loads(json.dumps(out))


def record_settings(record: dict) -> dict | None:
    """The settings a record holds, or None: unknown (none, not an object, or one without the command that made it:
    `"settings": {}` is no settings)."""
    s = record.get(FIELD)
    return s if isinstance(s, dict) and isinstance(s.get("command"), str) else None


def flatten(d: dict, prefix: str = "") -> dict:
    """{'config': {'max_steps': 3}} -> {'config.max_steps': 3}: the names settings_diff gives."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _norm(v):
    """Values compare after a JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(v))


def _typed(v):
    """A value as settings_diff compares it: true and 1 differ (JSON tells them apart, Python's == does not), 1 and
    1.0 do not (a float setting given as an int)."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, list):
        return [_typed(x) for x in v]
    if isinstance(v, dict):
        return {k: _typed(x) for k, x in v.items()}
    return v


def compared(settings: dict) -> dict:
    """The settings as the rule compares them: a model known by its fingerprint without its name (module
    docstring); a model without a fingerprint (settings written by hand) by its name."""
    model = settings.get("model")
    if isinstance(model, dict) and model.get("fingerprint") is not None:
        return {**settings, "model": {k: v for k, v in model.items() if k != "name"}}
    return settings


def settings_diff(got: dict, want: dict) -> list[str]:
    """The names of the settings in which two records differ, sorted (nested ones as 'config.max_steps'); [] when
    none: the one rule of every resume and of `report` (its runs are the records this rule finds equal). The model's
    name is not compared where both give its fingerprint (compared); where the files differ, their names are named
    too when they differ (they say which). NOTES (a fallback) are never compared."""
    a, b = flatten(_norm(compared(got))), flatten(_norm(compared(want)))
    diff = {k for k in set(a) | set(b) if _typed(a.get(k)) != _typed(b.get(k)) and k not in NOTES}
    names = [flatten(_norm(s)).get("model.name") for s in (got, want)]
    if names[0] == names[1]:  # one side without a fingerprint keeps its name in `compared`: not a difference
        diff.discard("model.name")
    elif "model.fingerprint" in diff:
        diff.add("model.name")
    return sorted(diff)


# what a setting is called in a message: the flag that sets it where there is one
SHORT = {"model.name": "model", "model.fingerprint": "model files", "outputs.generate": "--generate",
         "outputs.export": "--export", "outputs.max_new_tokens": "--max-new-tokens", "outputs.stop": "--stop",
         "time_budget_s": "--time-budget", "answers_at": "--answer-at", "add_special_tokens": "--add-special-tokens",
         "grid.Ns": "--study-N", "grid.mus": "--study-mu", "grid.estimators": "--study-estimators",
         "grid.seeds": "--seeds", "grid.points": "--points"}


def short_name(name: str) -> str:
    """'config.max_steps' -> 'max_steps', 'outputs.generate' -> '--generate', 'grid.Ns' -> '--study-N'."""
    return SHORT.get(name, name.split(".", 1)[1] if name.startswith("config.") else name)


def show(v, name: str = "") -> str:
    """A setting's value in a message: JSON, or 'off' / 'unset' for None."""
    return ("off" if name == "length_buckets" else "unset") if v is None else json.dumps(v, ensure_ascii=False)


def describe_diff(got: dict, want: dict, names: Sequence[str] | None = None, limit: int = 6) -> str:
    """'max_steps 2 / 3, dtype "float32" / "bfloat16"': each setting that differs with both values (got's first),
    at most `limit` of them."""
    names = settings_diff(got, want) if names is None else names
    if "outputs.generate" in names:  # the answers' length and stop strings come with --generate
        names = [n for n in names if n not in ("outputs.max_new_tokens", "outputs.stop")]
    a, b = flatten(_norm(got)), flatten(_norm(want))
    shown = ", ".join(f"{short_name(k)} {show(a.get(k), k)} / {show(b.get(k), k)}" for k in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_resume(records: Sequence[dict], want: dict, where: str,
                 variant: Callable[[dict], tuple[str, dict, dict] | None] | None = None) -> None:
    """Refuse to add records of settings `want` to a results file holding `records` of other settings, or of
    settings unknown (SiclError, one line naming what differs); `where`: the file, for the message. variant: for a
    command whose records differ by variant (icleval), record -> (its variant's name, what the record was run with,
    what this run runs that variant with), or None where this run does not run it: compared as the settings are."""
    unknown = [r for r in records if record_settings(r) is None]
    if unknown:
        raise SiclError(f"{where}: holds {len(unknown)} record(s) written without their settings (by a sicl_fast "
                        "before records carried them, or by hand): whether they match this run's cannot be told, so "
                        "this run does not add to them; use another --out")
    distinct = {json.dumps(record_settings(r), sort_keys=True): record_settings(r) for r in records}
    _refuse_mixed(list(distinct.values()), where)
    for got in distinct.values():  # a file holds one settings, or a few: each compared once
        if got.get("command") != want.get("command"):
            raise SiclError(f"{where}: holds records of sicl-fast {got.get('command')}, not of sicl-fast "
                            f"{want.get('command')}; use another --out")
        _refuse_other(got, want, where)
    if variant is not None:
        parts = (variant(r) for r in records)
        for name, got, asked in {json.dumps(p, sort_keys=True): p for p in parts if p is not None}.values():
            _refuse_other(got, asked, where, f" of variant {name!r}")


def _refuse_other(got: dict, want: dict, where: str, of: str = "") -> None:
    """check_resume's one message: the settings that differ, with both values (describe_diff), and where the file's
    records went on otherwise after a failed check of a captured step (a fallback), the flags that run as they did."""
    diff = settings_diff(got, want)
    if diff:
        why = (" (its records hold no calibrated embeddings to decode or export: they would be calibrated again, "
               "which another --out does)" if any(n.startswith("outputs.") for n in diff) else "")
        same = "the same settings"
        if isinstance(got.get("fallback"), str) and set(diff) <= set(FALLBACK_FLAGS):
            flags = " ".join(f"{flag} {got.get(n) or 'ieee'}" for n, flag in FALLBACK_FLAGS.items())
            same = (f"the settings they went on with after a failed check of a captured step ({got['fallback']}): "
                    f"{flags}")
        raise SiclError(f"{where}: its records{of} were made with other settings than this run's: "
                        f"{describe_diff(got, want, diff)} (the file's / this run's); use another --out{why} or "
                        f"{same}")


def _refuse_mixed(distinct: list[dict], where: str) -> None:
    """Refuse a file whose records were made with settings that differ among themselves (a run that fell back midway,
    or files joined by hand): no run's settings match them all, so none adds to it; the message says which differ."""
    for other in distinct[1:]:
        diff = settings_diff(distinct[0], other)
        if diff:
            note = next((s["fallback"] for s in distinct if isinstance(s.get("fallback"), str)), None)
            cause = (f"; its run went on otherwise midway, after a failed check of a captured step ({note})"
                     if note else "")
            raise SiclError(f"{where}: holds records of different settings ({describe_diff(distinct[0], other, diff)})"
                            f"{cause}: no run's settings match them all, so none adds to it; use another --out")


# the flags that set what a fallback changes (RunPlan.fallback: the torch ops, the math attention, whose precision a
# record holds where it is not IEEE): the message that says how to run as a fallback's records went on
FALLBACK_FLAGS = {"impl": "--impl", "attention": "--attn", "attention_precision": "--attn-precision"}


def resume_check(want: dict, where: str, variant: Callable[[dict], tuple[str, dict, dict] | None] | None = None
                 ) -> Callable[[Sequence[dict]], None]:
    """check_resume of `want` as a results writer takes it (sicl_fast.formats.records.ResultWriter's check)."""
    return lambda records: check_resume(records, want, where, variant)


__all__ = ["FORMAT", "FIELD", "plan_settings", "model_plan_settings", "engine_settings", "fallback_settings",
           "run_settings",
           "record_settings", "flatten", "compared", "settings_diff", "short_name", "describe_diff", "check_resume",
           "resume_check"]
