"""Running ICLEval with several methods at once: `base | sicl | cc | dcpmi | demo`, plus calibration ablations.

One record per (variant, task file, uid), (task, uid, label, answer_base,
answer_calibrated, correct_base, correct_calibrated, initial_proxy, best_proxy, steps, gated, seconds, history)
plus method, variant, model and config. For every method the *_base fields hold plain greedy decoding from the
original prompt (ICLEval's protocol) and the *_calibrated fields hold the method's answer, so one report compares
each method with the base:

* base:  the greedy answer itself (answer_calibrated = answer_base);
* sicl:  calibration with the variant's CalibrationConfig, then greedy decoding from the calibrated embeddings
         ; one variant per ablation (see `ablations`);
* sicl-grad: the same with the exact gradient (`grad_config`: estimator "grad" and every row normalised to step
         eta, the step length the zeroth-order step takes when its clip fires on every row, which it does at
         N << R d); the engine must be built with grad=True (the CLI does it when the method is asked for);
* cc, dcpmi, demo (classification files only, see `icleval_cls`): the label chosen by the baseline, scored by
         ICLEval's scorer. These records also carry answer_scored_base / correct_scored_base: the label with the
         highest probability after the original prompt (uncalibrated label scoring), and the label probabilities.

`seconds` is the time of the method's own answer (for sicl: calibration and decoding; for base: decoding);
calibration records also carry `calibration_seconds` (the calibration alone), `stop_reason` ("time_budget" when
a --time-budget ended it, with the budget under `time_budget_s`) and, with --answer-at, `answers_at`: the answer
decoded from the best X after each of those step counts ({"1": ..., "5": ...}; a count past the run's end gets
its final answer, counts past max_steps none; an X already decoded is not decoded again).
The base answer is decoded once per sample and shared by all variants. Records are written whole (ResultWriter),
so an interrupted run resumes where it stopped; a resumed run refuses records of another model or of a variant
whose settings changed. Every record carries its run's settings (sicl_fast.run.settings: the model, the run plan's
axes, the run's config, time budget and --answer-at): a resume refuses a file of other settings or of settings
unknown.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Sequence

from ..calibration.ascent import CalibrationConfig
from ..errors import ResultsFileError, SiclError
from ..icleval.convert import tokenize_sample
from ..icleval.loader import Sample, load_dir
from ..icleval.tasks import TASK_FILES
from ..icleval.scoring import max_gen_len, score, should_stop
from ..formats.inputs import of_type
from ..formats.records import STDOUT, ResultWriter, check_output, read_records
from ..run.settings import fallback_settings, resume_check, run_settings, settings_diff
from ..run.workers import as_workers, write_all
from .ablations import Variant, make_variants, variant_name
from .baselines import contextual_calibration, dc_pmi, demo_select
from .icleval_cls import (CONTENT_FREE_INPUTS, DCPMI_PREMISES, content_free_contexts, content_free_query,
                          continuations, dcpmi_premise, demo_blocks, is_classification, labels_for, reordered,
                          scoring_context, with_query, zero_shot_context)
from .label_scoring import LabelScorer

METHODS = ("base", "sicl", "sicl-grad", "cc", "dcpmi", "demo")
BASELINES = ("cc", "dcpmi", "demo")
CALIBRATIONS = ("sicl", "sicl-grad")  # methods whose answer decodes from calibrated embeddings


def grad_config(config):
    """The CalibrationConfig of method 'sicl-grad': `config` (the sicl settings: eta, kappa, tau, steps, ...) with
    the exact gradient, each row normalised to move eta (module docstring), and no SNR gate (it has no noise)."""
    return config.replace(estimator="grad", grad_mode="normalize", snr_threshold=0.0, checkpoint=False)


@dataclass(frozen=True)
class BaselineOptions:
    """Settings of the label-scoring baselines (stored in their records)."""

    cf_inputs: tuple[str, ...] = CONTENT_FREE_INPUTS  # CC's and DEmO's content-free inputs
    dcpmi_premise: str = "delimiter"  # "delimiter": "Output:" alone; "demos": demonstrations + "Output:"
    demo_orders: int = 24  # candidate orders (all n! when n! <= this)
    demo_top_k: int = 4  # orders kept by the label-fairness stage
    demo_seed: int = 0
    demo_influence: str = "zeroshot"  # reference of the influence KL: "zeroshot" or "content_free"
    demo_predict: str = "score"  # "score": argmax label; "generate": greedy decoding with the chosen order

    def __post_init__(self) -> None:
        if self.dcpmi_premise not in DCPMI_PREMISES:
            raise SiclError(f"dcpmi_premise must be one of {DCPMI_PREMISES}, got {self.dcpmi_premise!r}")
        if self.demo_orders < 1 or self.demo_top_k < 1:
            raise SiclError("demo_orders and demo_top_k must be >= 1")
        if self.demo_influence not in ("zeroshot", "content_free"):
            raise SiclError(f"demo_influence must be 'zeroshot' or 'content_free', got {self.demo_influence!r}")
        if self.demo_predict not in ("score", "generate"):
            raise SiclError(f"demo_predict must be 'score' or 'generate', got {self.demo_predict!r}")
        if not self.cf_inputs:
            raise SiclError("cf_inputs must hold at least one content-free input")

    def for_method(self, method: str) -> dict:
        d = dataclasses.asdict(self)
        d["cf_inputs"] = list(self.cf_inputs)
        if method == "cc":
            return {"cf_inputs": d["cf_inputs"]}
        if method == "dcpmi":
            return {"dcpmi_premise": self.dcpmi_premise}
        if method == "demo":
            return {k: v for k, v in d.items() if k != "dcpmi_premise"}
        return {}


_NUMBER = ((int, float), "a number")
# the JSON type of each field of a record that a resume or a report reads, as the methods write it (None: null too)
RECORD_FIELDS: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "task": ((str,), "a string", False), "uid": ((int,), "an integer", False),
    **{k: ((str,), "a string", True) for k in ("variant", "method", "model", "stop_reason")},
    **{k: ((bool,), "true or false", False) for k in ("correct_base", "correct_calibrated", "correct_scored_base")},
    "gated": ((bool,), "true or false", True), "config": ((dict,), "an object", True),
    "steps": ((int,), "an integer", True),
    **{k: (*_NUMBER, True) for k in ("seconds", "calibration_seconds", "initial_proxy", "best_proxy", "time_budget_s")},
    "history": ((list,), "a list of numbers", True), "answers_at": ((dict,), "an object {step: answer}", True),
}


def record_problem(rec: dict) -> str | None:
    """What is wrong with a record's fields (a hand edit, another program's file), in words, or None: each field of
    RECORD_FIELDS it has holds that JSON type (true is no number, "false" no boolean), the history numbers, the keys
    of answers_at step counts. The one check of a record's fields: a resume moves such a record aside (record_key
    raises), a report refuses it (report.check_records)."""
    for name, (types, what, nullable) in RECORD_FIELDS.items():
        if name not in rec or (rec[name] is None and nullable):
            continue
        if not of_type(rec[name], types):
            return f"field {name!r} must be {what}, got {json.dumps(rec[name])[:60]}"
    if not all(of_type(x, _NUMBER[0]) for x in rec.get("history") or ()):
        return f"field 'history' must be a list of numbers, got {json.dumps(rec['history'])[:60]}"
    bad = [k for k in rec.get("answers_at") or {} if not (k.isascii() and k.isdigit())]
    if bad:
        return f"field 'answers_at': {bad[0]!r} is not a step count"
    return None


def record_key(rec: dict) -> tuple[str, str, int]:
    """(variant, task, uid); records without a variant field (single-method runs) are the 'sicl' variant. Raises
    ValueError for a record whose fields do not read (record_problem): the results file moves it aside."""
    problem = record_problem(rec)
    if problem is not None:
        raise ValueError(problem)
    return rec.get("variant", "sicl"), rec["task"], rec["uid"]


def build_variants(methods: Sequence[str], engine=None, config=None, sicl_variants: Sequence[Variant] | None = None,
                   options: BaselineOptions | None = None) -> list[Variant]:
    """Variants in method order; 'sicl' expands to `sicl_variants` (default: `config` alone)."""
    options = options or BaselineOptions()
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SiclError(f"unknown method(s) {unknown}; choose from {METHODS}")
    out: list[Variant] = []
    for m in dict.fromkeys(methods):
        if m == "sicl":
            if sicl_variants is None:
                if config is None:
                    raise SiclError("method 'sicl' needs a CalibrationConfig")
                preset = engine.config() if engine is not None else None
                sicl_variants = [Variant(variant_name(config, preset), "sicl", config)]
            out += list(sicl_variants)
        elif m == "sicl-grad":
            if config is None:
                raise SiclError("method 'sicl-grad' needs a CalibrationConfig")
            out.append(Variant("sicl-grad", "sicl-grad", grad_config(config)))
        elif m == "base":
            out.append(Variant("base", "base"))
        else:
            out.append(Variant(m, m, options=options.for_method(m)))
    return out


def _applies(variant: Variant, sample: Sample) -> bool:
    return variant.method not in BASELINES or is_classification(sample.task_file)


def wanted_keys(samples: Sequence[Sample], variants: Sequence[Variant]) -> list[tuple[str, str, int]]:
    """The record_key of every record a run of `variants` on `samples` writes."""
    return [(v.name, s.task_file, s.uid) for s in samples for v in variants if _applies(v, s)]


def _common(sample: Sample, variant: Variant, model: str) -> dict:
    return {"task": sample.task_file, "uid": sample.uid, "label": sample.label, "method": variant.method,
            "variant": variant.name, "model": model}


class _Runner:
    def __init__(self, engine, options: BaselineOptions, time_budget_s: float | None = None,
                 answer_at: Sequence[int] = ()) -> None:
        self.engine = engine
        self.options = options
        self.time_budget_s = time_budget_s
        self.answer_at = tuple(answer_at)
        self.scorer = LabelScorer(engine.lm, add_special_tokens=True)
        self._base_for: tuple | None = None
        self._base = None
        self._calibrated: dict = {}  # (variant name, sample key) -> CalibrationResult, from calibrate_packed

    def prompt(self, sample: Sample):
        return sample_prompt(self.engine, sample)

    def decode(self, sample: Sample, prompt, embeds=None):
        stop = lambda text, s=sample: should_stop(s, text)  # noqa: E731 - ICLEval's allowed early stop
        return self.engine.generate(prompt, embeds, max_new_tokens=max_gen_len(sample), stop_strings=(), stop_fn=stop)

    def base(self, sample: Sample, prompt):
        """(Generation, seconds) of the greedy base answer, decoded once per sample."""
        if self._base_for != sample.key:
            t0 = time.perf_counter()
            gen = self.decode(sample, prompt)
            self._base, self._base_for = (gen, time.perf_counter() - t0), sample.key
        return self._base

    def record(self, sample: Sample, prompt, variant: Variant) -> dict:
        gen, base_seconds = self.base(sample, prompt)
        rec = _common(sample, variant, self.engine.lm.name)
        rec["config"] = variant.config_dict()
        rec.update({"answer_base": gen.text, "correct_base": score(sample, gen.text)})
        t0 = time.perf_counter()
        if variant.method == "base":
            rec.update({"answer_calibrated": gen.text, "correct_calibrated": rec["correct_base"],
                        "initial_proxy": None, "best_proxy": None, "steps": 0, "gated": None,
                        "seconds": round(base_seconds, 3), "history": []})
            return rec
        if variant.method in CALIBRATIONS:
            res = self._calibrated.pop((variant.name, sample.key), None)
            if res is None:
                res = self.engine.calibrate(prompt, variant.config, time_budget_s=self.time_budget_s,
                                            best_at=self.answer_at)
            cal = gen if res.best_step == 0 else self.decode(sample, prompt, res.embeddings)
            rec.update({"answer_calibrated": cal.text, "correct_calibrated": score(sample, cal.text),
                        "initial_proxy": res.initial_proxy, "best_proxy": res.best_proxy, "steps": res.steps,
                        "gated": res.gated, "seconds": round(time.perf_counter() - t0, 3), "history": res.history,
                        "best_step": res.best_step, "stop_reason": res.stop_reason,
                        "calibration_seconds": round(res.seconds, 3)})
            if self.time_budget_s is not None:
                rec["time_budget_s"] = self.time_budget_s
            if self.answer_at:
                rec["answers_at"] = self.answers_at(sample, prompt, res, {0: gen.text, res.best_step: cal.text})
            return rec
        extra = getattr(self, "_" + variant.method)(sample)
        rec.update({"answer_calibrated": extra.pop("answer"), "initial_proxy": None, "best_proxy": None,
                    "steps": 0, "gated": None})
        rec["correct_calibrated"] = score(sample, rec["answer_calibrated"])
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        rec["history"] = []
        rec.update(extra)
        return rec

    def answers_at(self, sample: Sample, prompt, res, decoded: dict[int, str]) -> dict[str, str]:
        """The answer from the best X after each count of answer_at up to max_steps (module docstring). decoded:
        best step -> answer, the ones known (the base and final answers), grown as it decodes."""
        out = {}
        for k in self.answer_at:
            if k > res.config.max_steps:
                continue
            best_step, X = res.best_at.get(k, (res.best_step, res.embeddings))
            if best_step not in decoded:
                decoded[best_step] = self.decode(sample, prompt, X).text
            out[str(k)] = decoded[best_step]
        return out

    def calibrate_packed(self, chunk) -> None:
        """With engine.plan.pack > 1: calibrate the 'sicl' variants of a chunk of samples [(sample, variants)]
        together, `pack` at once (sicl_fast.calibration.packed); record() then takes their results."""
        work = [(s, v) for s, vs in chunk for v in vs if v.method == "sicl"]
        if self.engine.plan.pack <= 1 or not work:
            return
        from ..calibration.packed import run_packed

        def keep(i: int, res) -> None:
            s, v = work[i]
            self._calibrated[(v.name, s.key)] = res

        run_packed(self.engine.backend, [(self.prompt(s), self.engine.config(v.config)) for s, v in work],
                   self.engine.plan.pack, self.engine.plan.sync_every, on_result=keep,
                   time_budget_s=self.time_budget_s, best_at=self.answer_at)

    # -- baselines ----------------------------------------------------------------------------------------------
    def _scored_base(self, sample: Sample, labels, p) -> dict:
        k = max(range(len(labels)), key=lambda i: p[i])
        return {"labels": list(labels), "answer_scored_base": labels[k],
                "correct_scored_base": score(sample, labels[k])}

    def _cc(self, sample: Sample) -> dict:
        labels = labels_for(sample)
        r = contextual_calibration(self.scorer, scoring_context(sample),
                                   content_free_contexts(sample, self.options.cf_inputs), continuations(labels))
        return {"answer": labels[r.pred], **self._scored_base(sample, labels, r.p),
                "probs": r.p.tolist(), "probs_content_free": r.p_cf.tolist(), "probs_calibrated": r.q.tolist()}

    def _dcpmi(self, sample: Sample) -> dict:
        labels = labels_for(sample)
        premise = dcpmi_premise(sample, self.options.dcpmi_premise)
        r = dc_pmi(self.scorer, scoring_context(sample), premise, continuations(labels))
        return {"answer": labels[r.pred], **self._scored_base(sample, labels, r.logp),
                "logp": r.logp.tolist(), "logp_domain": r.logp_domain.tolist(), "pmi": r.scores.tolist()}

    def _demo(self, sample: Sample) -> dict:
        labels = labels_for(sample)
        opts = self.options

        def build(order, cf):
            s = reordered(sample, order)
            if cf is not None:
                s = with_query(s, content_free_query(sample, cf))
            return scoring_context(s)

        r = demo_select(self.scorer, build, len(demo_blocks(sample)), continuations(labels), opts.cf_inputs,
                        zero_shot_context(sample), num_orders=opts.demo_orders, top_k=opts.demo_top_k,
                        seed=f"{opts.demo_seed}:{sample.task_file}:{sample.uid}",
                        influence_reference=opts.demo_influence)
        out = {"answer_scored": labels[r.pred], "correct_scored": score(sample, labels[r.pred])}
        if opts.demo_predict == "generate":
            gen = self.decode(sample, self.prompt(reordered(sample, r.order)))
            out.update({"answer": gen.text, "answer_generated": gen.text})
        else:
            out["answer"] = labels[r.pred]
        out.update(self._scored_base(sample, labels, r.p_orders[0]))  # orders[0] is the original order
        out.update({"order": list(r.order), "orders_evaluated": len(r.orders),
                    "fairness": r.fairness[r.chosen], "influence": r.influence[r.chosen],
                    "candidates": [list(r.orders[i]) for i in r.candidates], "probs": list(map(float, r.p))})
        return out


def sample_prompt(engine, sample: Sample):
    """The sample's Prompt (ICLEval's tokenization; a prompt that does not fit the model is an error)."""
    return tokenize_sample(sample, engine.lm.tokenizer, engine.lm.max_context)


def check_samples(engine, samples: Sequence[Sample], configs: Sequence = ()) -> int:
    """Tokenize every sample before any work, so a bad one stops the run before anything is written, and refuse what
    calibrating them under each of `configs` (the calibrating variants') would refuse on the way (Engine.check_steps:
    a step too big for memory; packed prompts of different rotary tables)."""
    prompts = [sample_prompt(engine, s) for s in samples]
    engine.check_steps(prompts, configs)
    return len(samples)


def sample_records(engine, chunk: Sequence[tuple[Sample, Sequence[Variant]]], options: BaselineOptions,
                   time_budget_s: float | None = None, answer_at: Sequence[int] = ()) -> list[dict]:
    """The work function of a chunk of samples (one, or engine.plan.pack of them): the records of each sample's
    variants (its base answer decoded once, shared). With engine.plan.pack > 1 the chunk's calibrations run packed.
    time_budget_s and answer_at: each calibration's (module docstring).

    A fresh runner per sample, so a record depends on its sample alone, not on what the engine ran before it (the
    label scorer's prefix cache): any worker, any number of workers, gives the same records (packed calibrations
    to float rounding, see sicl_fast.calibration.packed)."""
    packed = _Runner(engine, options, time_budget_s, answer_at)
    packed.calibrate_packed(chunk)
    out = []
    for sample, variants in chunk:
        runner = _Runner(engine, options, time_budget_s, answer_at)
        runner._calibrated = packed._calibrated
        prompt = runner.prompt(sample)
        # after a failed capture check, what the run went on with (the records of calibrate do the same)
        out += [{**runner.record(sample, prompt, v), **fallback_settings(engine)} for v in variants]
    return out


def lost_records(chunk: Sequence[tuple[Sample, Sequence[Variant]]], message: str, model: str,
                 time_budget_s: float | None = None) -> list[dict]:
    """The error records of samples whose worker died too often: one per variant, with the message (and the time
    budget of the calibrations, a setting of the run as variant_settings reads it)."""
    budget = {"time_budget_s": time_budget_s} if time_budget_s is not None else {}
    return [{**_common(sample, v, model), "config": v.config_dict(), "error": message,
             **(budget if v.method in CALIBRATIONS else {})}
            for sample, variants in chunk for v in variants]


CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CalibrationConfig)}


def _settings(config: dict, method: str, time_budget_s: float | None, answers_at: Iterable | None = None) -> dict:
    """What a record of a variant was run with: its config (a config field added since the record was written
    takes its default, which is what the record ran with) and, for calibrations, the time budget and the step
    counts answered at (--answer-at; those up to max_steps, as `answers_at` holds them; None: not compared)."""
    if method not in CALIBRATIONS:
        return config
    out = {**CONFIG_DEFAULTS, **config, "time_budget_s": time_budget_s}
    if answers_at is not None:
        limit = out["max_steps"]
        out["answers_at"] = sorted({int(k) for k in answers_at if int(k) <= limit})
    return out


def resume_rule(want: dict, variants: Sequence[Variant], path, time_budget_s: float | None = None,
                answer_at: Sequence[int] = ()):
    """The resume check of an icleval run of settings `want` (icleval_settings), as a results writer takes it: the
    one rule of every command (sicl_fast.run.settings.check_resume), with each variant's part. A record of a variant
    this run runs was run with its config (a baseline's options), time budget and answers along the way
    (variant_settings), which must be what this run runs that variant with (the answers too: a record without the
    counts asked for now would be skipped without them)."""
    asked = {v.name: _settings(v.config_dict(), v.method, time_budget_s, answer_at) for v in variants}

    def variant(rec: dict):
        name = rec.get("variant", "sicl")
        if name not in asked or not isinstance(rec.get("config"), dict):
            return None
        return name, variant_settings(rec, asked[name]), asked[name]

    return resume_check(want, f"--out {path}", variant)


def icleval_settings(engine: dict, config, time_budget_s: float | None = None,
                     answer_at: Sequence[int] = ()) -> dict:
    """The settings of an icleval run's records (sicl_fast.run.settings): the engine's part, the run's config (the
    one its variants derive from; None where it calibrates nothing), the time budget and the step counts answered
    at (--answer-at, those up to max_steps)."""
    limit = config.max_steps if config is not None else None
    answers = sorted({int(k) for k in answer_at if limit is None or int(k) <= limit})
    return run_settings("icleval", engine, config, time_budget_s=time_budget_s, answers_at=answers)


def variant_settings(rec: dict, like: dict | None = None) -> dict:
    """What the record `rec` (with a "config") was run with (_settings). A failed sample's record (lost_records)
    holds no answers along the way, and an older version's no time budget: those are taken from `like` (the
    settings it is compared with), not compared."""
    failed = "error" in rec
    answers = None if failed else rec.get("answers_at") or {}
    got = _settings(rec["config"], rec.get("method", "sicl"), rec.get("time_budget_s"), answers)
    if failed and like is not None:
        for name in ("answers_at",) + (() if "time_budget_s" in rec else ("time_budget_s",)):
            if name in like:
                got[name] = like[name]
    return got


def select_samples(data_dir, tasks=None, limit: int | None = None) -> list[Sample]:
    """The first `limit` samples (all when None) of each task file in data_dir (all files present, or `tasks`)."""
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise SiclError(f"limit: must be an integer >= 1 (samples per task file), got {limit!r}")
    data = load_dir(data_dir, tasks)
    return [s for name in data for s in (data[name][:limit] if limit is not None else data[name])]


def check_records_out(out_path, data_dir=None) -> None:
    """The records are read back for the tables: --out must be a regular file (or a new one), not '-' or a pipe; and
    none of the task files of `data_dir` (by identity: a link to one too), whose lines the results file would move
    aside as unreadable records, leaving the task file empty."""
    if str(out_path) == STDOUT or (Path(out_path).exists() and not Path(out_path).is_file()):
        raise ResultsFileError(f"--out {out_path}: icleval reads its records back for the tables; give a regular file")
    tasks = [] if data_dir is None else [Path(data_dir) / f"{name}.json" for name in TASK_FILES]
    check_output(out_path, inputs=[p for p in tasks if p.is_file()])


def run_methods(
    engine,
    data_dir: str | Path,
    out_path: str | Path,
    methods: Sequence[str] = ("sicl",),
    config=None,
    tasks=None,
    limit: int | None = None,
    sicl_variants: Sequence[Variant] | None = None,
    options: BaselineOptions | None = None,
    progress: bool = True,
    pack: int = 1,
    time_budget_s: float | None = None,
    answer_at: Sequence[int] = (),
) -> list[dict]:
    """Run every variant on the selected samples; returns their records (those already in out_path included).
    pack: samples handed to a worker together, whose calibrations run packed when its engine has pack > 1.
    time_budget_s, answer_at: each calibration's time budget and the step counts at which its answer is also
    decoded (module docstring).

    engine: an Engine built with add_special_tokens=True (ICLEval's tokenization), or Workers over such engines
    (sicl_fast.run.workers; e.g. a Ray pool: the samples are dealt out to it one at a time). config: the
    CalibrationConfig of method 'sicl' (or give `sicl_variants`, e.g. from `ablations.make_variants`).
    """
    import functools

    from ..run.progress import StepProgress, progress_bar

    check_records_out(out_path, data_dir)
    options = options or BaselineOptions()
    workers = as_workers(engine)
    variants = build_variants(methods, workers, config, sicl_variants, options)
    samples = select_samples(data_dir, tasks, limit)
    # every tokenization error and every step refused before any work
    workers.call(check_samples, samples, [v.config for v in variants if v.method in CALIBRATIONS])
    for v in variants:
        if v.method in BASELINES:
            for s in samples:
                if is_classification(s.task_file):
                    labels_for(s)
                    demo_blocks(s) if v.method == "demo" else content_free_query(s, "N/A")
            if not any(is_classification(s.task_file) for s in samples):
                print(f"note: method {v.method!r} applies to classification files only "
                      f"(classifier_order, classifier_duplication, classifier_format); none selected", file=sys.stderr)
    model = workers.model_name
    want = icleval_settings(workers.settings, config, time_budget_s, answer_at)
    check = resume_rule(want, variants, out_path, time_budget_s, answer_at)
    with ResultWriter(out_path, key=record_key, settings=want, check=check) as out:
        todo = [(s, [v for v in variants if _applies(v, s) and (v.name, s.task_file, s.uid) not in out])
                for s in samples]
        todo = [(s, vs) for s, vs in todo if vs]
        n_todo = sum(len(vs) for _, vs in todo)
        done_before = sum(1 for s in samples for v in variants if _applies(v, s)) - n_todo
        if done_before:
            print(f"resuming: {done_before} records already in {out_path}", file=sys.stderr)
        chunks = [todo[i:i + pack] for i in range(0, len(todo), pack)]  # pack > 1: packed calibrations
        max_steps = max((v.config.max_steps for v in variants if v.config is not None), default=0)
        # the bar is closed (its line ended) before any error is printed
        with progress_bar(n_todo, "icleval", unit="rec", disable=not progress) as bar:
            write_all(workers, functools.partial(sample_records, options=options, time_budget_s=time_budget_s,
                                                 answer_at=tuple(answer_at)), chunks, out,
                      functools.partial(lost_records, model=model, time_budget_s=time_budget_s), bar,
                      StepProgress(bar, max_steps) if progress else None)
    wanted = set(wanted_keys(samples, variants))
    return [r for r in read_records(out_path) if record_key(r) in wanted]


__all__ = [
    "METHODS",
    "BASELINES",
    "CALIBRATIONS",
    "grad_config",
    "BaselineOptions",
    "build_variants",
    "record_key",
    "icleval_settings",
    "resume_rule",
    "variant_settings",
    "settings_diff",
    "run_methods",
    "check_records_out",
    "select_samples",
    "wanted_keys",
    "make_variants",
    "sample_records",
    "check_samples",
]
