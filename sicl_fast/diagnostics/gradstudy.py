"""The estimator study (`sicl-fast gradstudy`): how close the zeroth-order estimate comes to the exact gradient.

For each prompt, at points along an exact-gradient calibration (step 0 is X0; step k is the X after k exact steps,
each row normalised to move eta, the sicl-grad rule), with g* = df/dX on rows [a, b) (sicl_fast.calibration.grad):

    for mu in mus, seed in seeds:
        U [N_max, R, d]: the directions of (seed, step); a run with N <= N_max directions draws exactly the first N
        (the counter-based stream, sicl_fast.step.rng), so one set of forwards serves every N
        f0 = f(X), f_i+ = f(X + mu U_i), f_i- = f(X - mu U_i)            (plain float32 forwards, batched)
        for N in Ns, estimator in (forward, central):
            g = zo.estimate_gradient(first N)                              (the engine's own estimate)
            cosine(g, g*) over rows [a, b); per-row norm ratio: the median over rows with g*_r != 0 of
            |g_r| / |g*_r|; clip share: rows with |g_r| > clip_norm; one-step gain: f(step(g)) - f(X)
    the exact step's gain f(step(g*)) - f(X) and clip share, for comparison

where step(.) is the calibration's own update (zo.ascend through the backend's ops: clip or normalise per the
config's grad_mode, eta, cosine projection). mu is in units of the embedding scale, as everywhere.

study_prompt() returns one JSON-ready record per prompt; summarize() pools the records into the table (means over
prompts, points and seeds per estimator, mu and N); the CLI writes the records (resumable JSONL, each with its
settings, study_settings: a resume of another grid, config, model or plan is refused, so a table never pools two),
the table and a plot of cosine against N, one line per mu.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch

from ..calibration.ascent import CalibrationConfig, Calibrator
from ..errors import SiclError
from ..calibration.grad import proxy_gradient
from ..run.knobs import check_mu
from ..run.settings import run_settings
from ..formats.spans import Prompt
from ..step.zo import estimate_gradient, step_directions

STUDY_NS = (4, 8, 16, 32, 64)
STUDY_MUS = (0.001, 0.004, 0.016)
STUDY_ESTIMATORS = ("forward", "central")


@dataclass(frozen=True)
class StudySettings:
    """The grid of one study: numbers of directions, radii (embedding-scale units), estimators, seeds per cell,
    the calibration steps at which to measure, and forward rows per batch (memory)."""

    Ns: tuple[int, ...] = STUDY_NS
    mus: tuple[float, ...] = STUDY_MUS
    estimators: tuple[str, ...] = STUDY_ESTIMATORS
    seeds: int = 8
    points: tuple[int, ...] = (0, 5, 10)
    chunk: int = 16

    def __post_init__(self) -> None:
        checks = [
            (bool(self.Ns) and all(isinstance(n, int) and n >= 1 for n in self.Ns), "Ns must be integers >= 1"),
            (bool(self.mus) and all(isinstance(m, numbers.Real) and math.isfinite(m) for m in self.mus),
             "mus must be finite numbers"),
            (bool(self.estimators) and all(e in STUDY_ESTIMATORS for e in self.estimators),
             f"estimators must be among {STUDY_ESTIMATORS}"),
            (isinstance(self.seeds, int) and self.seeds >= 1, "seeds must be an integer >= 1"),
            (bool(self.points) and all(isinstance(p, int) and p >= 0 for p in self.points),
             "points must be integers >= 0 (calibration steps)"),
            (list(self.points) == sorted(set(self.points)), "points must be increasing, without repeats"),
            (isinstance(self.chunk, int) and self.chunk >= 1, "chunk must be an integer >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SiclError(f"gradstudy: {msg}")
        for m in self.mus:  # CalibrationConfig's rule for mu, before a model loads
            check_mu(m, "gradstudy", f"mu {m:g}")


def study_settings(engine: dict, config: CalibrationConfig, settings: StudySettings,
                   add_special_tokens: bool = False) -> dict:
    """The settings of gradstudy's records (sicl_fast.run.settings): the engine's part, the config, the special tokens
    and the study's grid (every field of StudySettings but chunk, the forward rows per batch: memory)."""
    grid = {k: v for k, v in dataclasses.asdict(settings).items() if k != "chunk"}
    return run_settings("gradstudy", engine, config, add_special_tokens=add_special_tokens, grid=grid)


def _cosine(g: torch.Tensor, ref: torch.Tensor) -> float:
    """cos over the flattened [R, d] matrices, in float64 (nan when either is 0)."""
    a, b = g.double().flatten(), ref.double().flatten()
    den = float(a.norm() * b.norm())
    return float(torch.dot(a, b)) / den if den > 0 else math.nan


def _norm_ratio(g: torch.Tensor, ref: torch.Tensor) -> float:
    """Median over rows with a nonzero exact gradient of |g_r| / |g*_r| (nan when there is none)."""
    rn = ref.double().norm(dim=-1)
    keep = rn > 0
    if not bool(keep.any()):
        return math.nan
    return float((g.double().norm(dim=-1)[keep] / rn[keep]).median())


def _clip_share(g: torch.Tensor, clip_norm: float) -> float:
    """Share of rows whose clip fires (|g_r| > clip_norm)."""
    return float((g.norm(dim=-1) > clip_norm).double().mean())


class _Proxy:
    """f of many [b, d] matrices, batched `chunk` rows at a time through the backend's plain forward."""

    def __init__(self, cal: Calibrator, prompt: Prompt, chunk: int) -> None:
        self.cal, self.prompt, self.chunk = cal, prompt, chunk

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, b, d] float32 -> f [n] float64 (on the CPU)."""
        out = [self.cal.proxy_of(rows[i:i + self.chunk], self.prompt).f.double().cpu()
               for i in range(0, rows.shape[0], self.chunk)]
        return torch.cat(out)


def study_point(cal: Calibrator, prompt: Prompt, X: torch.Tensor, X0: torch.Tensor, step: int,
                settings: StudySettings) -> tuple[dict, torch.Tensor]:
    """The measurements at X [L, d] (module docstring). Returns (the point's record, g* [R, d])."""
    cfg, ops = cal.config, cal.ops
    spec = cal.step_spec(prompt, X0)  # rows [a, b), eta, clip / normalise, projection of the calibration's update
    a, b, Nmax = spec.a, spec.b, max(settings.Ns)
    f_of = _Proxy(cal, prompt, settings.chunk)
    out, g_star = proxy_gradient(cal.backend, prompt, X, cfg.replace(estimator="grad"), spec)
    f0 = float(out.f[0])
    # the exact step, then every zeroth-order step: their X[:b] gathered, f of all of them at the end
    moved = [ops.ascend(X, X0, g_star, spec)[0][:b]]
    cells = []  # (estimator, mu, N, seed, cosine, norm ratio, clip share)
    for mu in settings.mus:
        mu_eff = mu * cfg.scale
        for s in range(settings.seeds):
            seed = (cfg.seed + s) % 2**32
            U = step_directions(step, dataclasses.replace(spec, N=Nmax, seed=seed), X.device)  # [N_max, R, d]
            block = X[:b].unsqueeze(0)
            plus, minus = block.repeat(Nmax, 1, 1), block.repeat(Nmax, 1, 1)
            plus[:, a:b] += mu_eff * U
            minus[:, a:b] -= mu_eff * U
            need_minus = "central" in settings.estimators
            fp = f_of(plus)
            fm = f_of(minus) if need_minus else None
            for est in settings.estimators:
                for N in settings.Ns:
                    if est == "forward":
                        f = torch.cat([torch.tensor([f0], dtype=torch.float64), fp[:N]])
                    else:
                        f = torch.stack([fp[:N], fm[:N]], dim=1).flatten()
                        f = torch.cat([torch.tensor([f0], dtype=torch.float64), f])  # layout of step.zo
                    g = estimate_gradient(f, U[:N], mu_eff, est)
                    cells.append((est, mu, N, s, _cosine(g, g_star), _norm_ratio(g, g_star),
                                  _clip_share(g, spec.clip_norm)))
                    moved.append(ops.ascend(X, X0, g, spec)[0][:b])
    f_moved = f_of(torch.stack(moved)) - f0  # [1 + cells] one-step gains
    rows = []
    for est in settings.estimators:
        for mu in settings.mus:
            for N in settings.Ns:
                idx = [i for i, c in enumerate(cells) if c[:3] == (est, mu, N)]
                cos = [cells[i][4] for i in idx]
                gain = [float(f_moved[1 + i]) for i in idx]
                rows.append({"estimator": est, "mu": mu, "N": N, "seeds": len(idx),
                             "cosine_mean": statistics.fmean(cos), "cosine_std": _std(cos),
                             "norm_ratio": statistics.fmean(cells[i][5] for i in idx),
                             "clip_share": statistics.fmean(cells[i][6] for i in idx),
                             "gain_mean": statistics.fmean(gain), "gain_std": _std(gain)})
    point = {"step": step, "proxy": f0, "exact": {"gain": float(f_moved[0]), "clip_share": _clip_share(
        g_star, spec.clip_norm), "norm": float(g_star.double().norm())}, "zo": rows}
    return point, g_star


def _std(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def walk_config(config: CalibrationConfig) -> CalibrationConfig:
    """The config of the walk between a study's points: an exact-gradient calibration with every row normalised to
    move eta (what the CLI checks the memory of before its results file opens)."""
    return config.replace(estimator="grad", grad_mode="normalize", snr_threshold=0.0, checkpoint=False)


def study_prompt(backend, prompt: Prompt, config: CalibrationConfig, settings: StudySettings,
                 on_point: Callable[[int], None] | None = None) -> dict:
    """The study of one prompt: one record {id, L, rows, scale, points: [study_point records]}. The walk between
    points is an exact-gradient calibration with every row normalised to move eta (patience and gate off: the
    points are measured wherever the walk is)."""
    backend.plan.check_grad()
    walk_cfg = walk_config(config)
    walk = Calibrator(backend, walk_cfg)
    cal = Calibrator(backend, config.replace(estimator="forward", snr_threshold=0.0, checkpoint=False))
    X0 = walk.initial_embeddings(prompt)
    walk_spec = walk.step_spec(prompt, X0)
    X, points, k = X0.clone(), [], 0
    for target in settings.points:
        while k < target:
            out, g = proxy_gradient(backend, prompt, X, walk_cfg, walk_spec)
            X = walk.ops.ascend(X, X0, g, walk_spec)[0]
            k += 1
        point, _ = study_point(cal, prompt, X, X0, k, settings)
        points.append(point)
        if on_point is not None:
            on_point(k)
    return {"id": prompt.id, "L": prompt.length, "rows": walk_spec.rows, "d": walk_spec.d,
            "scale": cal.config.scale, "points": points}


def _numbers(obj, names: Sequence[str]) -> bool:
    return isinstance(obj, dict) and all(isinstance(obj.get(k), (int, float)) and not isinstance(obj.get(k), bool)
                                         for k in names)


def _point_reads(p) -> bool:
    """Whether one point of a record holds what summarize reads, of its JSON types (study_prompt's form)."""
    return (isinstance(p, dict) and _numbers(p.get("exact"), ("gain", "clip_share")) and isinstance(p.get("zo"), list)
            and all(_numbers(z, ("mu", "N", "cosine_mean", "norm_ratio", "clip_share", "gain_mean"))
                    and z.get("estimator") in STUDY_ESTIMATORS for z in p["zo"]))


def study_key(rec: dict) -> str:
    """The id of a gradstudy record (the results file's key) whose fields read as study_prompt writes them: its
    length, rows and points of numbers. ValueError for any other (a hand edit, a torn repair): the results file moves
    it aside and its prompt is studied again, where summarize and the report raised on it (an internal error)."""
    if not (isinstance(rec.get("id"), str) and _numbers(rec, ("L", "rows")) and isinstance(rec.get("points"), list)
            and all(_point_reads(p) for p in rec["points"])):
        raise ValueError("not a record of gradstudy")
    return rec["id"]


def summarize(records: Sequence[dict]) -> list[dict]:
    """One row per (estimator, mu, N): means over every prompt and point of the per-point means (cosine, norm
    ratio, clip share, ZO gain), the exact step's mean gain and clip share at the same points, and n (points)."""
    cells: dict[tuple, list[tuple[dict, dict]]] = {}
    for rec in records:
        for p in rec["points"]:
            for r in p["zo"]:
                cells.setdefault((r["estimator"], r["mu"], r["N"]), []).append((r, p["exact"]))
    out = []
    for (est, mu, N), items in sorted(cells.items(), key=lambda kv: (STUDY_ESTIMATORS.index(kv[0][0]), kv[0][1],
                                                                   kv[0][2])):
        out.append({"estimator": est, "mu": mu, "N": N, "n": len(items),
                    "cosine": statistics.fmean(r["cosine_mean"] for r, _ in items),
                    "norm_ratio": statistics.fmean(r["norm_ratio"] for r, _ in items),
                    "clip_share": statistics.fmean(r["clip_share"] for r, _ in items),
                    "gain_zo": statistics.fmean(r["gain_mean"] for r, _ in items),
                    "gain_exact": statistics.fmean(e["gain"] for _, e in items),
                    "exact_clip_share": statistics.fmean(e["clip_share"] for _, e in items)})
    return out


def markdown(rows: Sequence[dict]) -> str:
    """The summary table (summarize's rows) in Markdown."""
    L = ["| estimator | mu | N | points | cos(g, g*) | median row norm ratio |g_r|/|g*_r| | ZO rows clipped | "
         "exact rows clipped | one-step gain ZO | one-step gain exact |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['estimator']} | {r['mu']:g} | {r['N']} | {r['n']} | {r['cosine']:.4f} | "
                 f"{r['norm_ratio']:.3g} | {100 * r['clip_share']:.0f}% | {100 * r['exact_clip_share']:.0f}% | "
                 f"{r['gain_zo']:+.2e} | {r['gain_exact']:+.2e} |")
    return "\n".join(L)


def write_report(out_dir, rows: Sequence[dict], records: Sequence[dict], settings: StudySettings,
                 title: str = "") -> list[str]:
    """out_dir/study.md (the table and what was measured), study.json (the rows) and plots/cosine_vs_N.png;
    returns the paths written."""
    import json
    from pathlib import Path

    from ..evaluation import plots
    from ..formats.records import write_text_atomic

    out = Path(out_dir)
    png = plots.estimator_cosines(out / "plots" / "cosine_vs_N.png", rows, title)
    prompts = ", ".join(f"{r['id']} (L={r['L']}, R={r['rows']})" for r in records)
    md = [f"# Estimator study{': ' + title if title else ''}", "",
          f"Prompts: {prompts}. Points (exact-gradient calibration steps): {list(settings.points)}; "
          f"{settings.seeds} seeds per cell; mu in units of the embedding scale.", "",
          markdown(rows), "", f"![cosine vs N]({png.relative_to(out)})", ""]
    write_text_atomic(out / "study.md", "\n".join(md))
    write_text_atomic(out / "study.json", json.dumps({"settings": dataclasses.asdict(settings), "rows": rows},
                                                     indent=1))
    return [str(out / "study.md"), str(out / "study.json"), str(png)]


__all__ = ["StudySettings", "study_settings", "STUDY_NS", "STUDY_MUS", "STUDY_ESTIMATORS", "study_point",
           "study_prompt", "summarize", "markdown", "walk_config", "write_report"]
