"""Ablations of the calibration as named variants of a CalibrationConfig; each produces ordinary records.

* a proxy component off: alpha, beta or gamma set to 0 and the other two rescaled so that the three weights keep
  their sum (1 for the paper's 0.6 / 0.3 / 0.1): alpha off -> beta 0.75, gamma 0.25;
* perturbing the query rows too: CalibrationConfig.perturb_query = True;
* sweeps over N (directions per step) and mu (smoothing radius, in units of the embedding scale).

A variant's name is derived from how its config differs from the model's preset, so the same settings always get
the same name: "sicl", "sicl[no-alpha]", "sicl[perturb-query]", "sicl[N=4]", "sicl[mu=0.008]",
"sicl[no-beta,N=4]". Other differences (e.g. --max-steps) do not enter the name; records keep the whole config and
a resumed run refuses a variant whose config changed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Iterable

from ..calibration.ascent import CalibrationConfig
from ..errors import SiclError

COMPONENTS = ("alpha", "beta", "gamma")
ABLATIONS = COMPONENTS + ("perturb-query",)


@dataclass(frozen=True)
class Variant:
    name: str
    method: str  # "sicl", or a baseline / "base"
    config: CalibrationConfig | None = None
    options: dict | None = None  # baseline options

    def config_dict(self) -> dict:
        if self.config is not None:
            return dataclasses.asdict(self.config)
        return dict(self.options or {})


def drop_component(config: CalibrationConfig, component: str) -> CalibrationConfig:
    """The config with one proxy weight at 0 and the other two rescaled to keep the weights' sum."""
    if component not in COMPONENTS:
        raise SiclError(f"unknown proxy component {component!r}; choose one of {COMPONENTS}")
    w = {c: getattr(config, c) for c in COMPONENTS}
    total = sum(w.values())
    rest = total - w[component]
    if rest <= 0:
        raise SiclError(f"cannot turn {component} off: the other weights sum to {rest}")
    new = {c: (0.0 if c == component else w[c] * total / rest) for c in COMPONENTS}
    return config.replace(**new)


def variant_name(config: CalibrationConfig, preset: CalibrationConfig | None = None) -> str:
    """'sicl' plus the ablation tags of `config` relative to `preset` (the model's preset)."""
    tags = [f"no-{c}" for c in COMPONENTS if getattr(config, c) == 0 and (preset is None or getattr(preset, c) != 0)]
    if config.perturb_query and not (preset is not None and preset.perturb_query):
        tags.append("perturb-query")
    if preset is not None and config.N != preset.N:
        tags.append(f"N={config.N}")
    if preset is not None and config.mu != preset.mu:
        tags.append(f"mu={config.mu:g}")
    return "sicl" + (f"[{','.join(tags)}]" if tags else "")


def make_variants(
    config: CalibrationConfig,
    preset: CalibrationConfig | None = None,
    ablate: Iterable[str] = (),
    sweep_N: Iterable[int] = (),
    sweep_mu: Iterable[float] = (),
    reference: bool = True,
) -> list[Variant]:
    """The calibration variants of a run: `config` itself (unless reference=False when ablations are asked for),
    one per ablated component / perturb-query, one per N and one per mu of the sweeps."""
    ablate, sweep_N, sweep_mu = list(ablate or ()), list(sweep_N or ()), list(sweep_mu or ())
    configs: list[CalibrationConfig] = []
    if reference or not (ablate or sweep_N or sweep_mu):
        configs.append(config)
    for a in ablate:
        if a == "perturb-query":
            configs.append(config.replace(perturb_query=True))
        else:
            configs.append(drop_component(config, a))
    configs += [config.replace(N=int(n)) for n in sweep_N]
    configs += [config.replace(mu=float(m)) for m in sweep_mu]
    out: list[Variant] = []
    seen: dict[str, CalibrationConfig] = {}
    for c in configs:
        name = variant_name(c, preset)
        if name in seen:
            if seen[name] != c:  # pragma: no cover - names are derived from the fields that differ
                raise SiclError(f"two different configs would share the variant name {name!r}")
            continue
        seen[name] = c
        out.append(Variant(name=name, method="sicl", config=c))
    return out


__all__ = ["Variant", "COMPONENTS", "ABLATIONS", "drop_component", "variant_name", "make_variants"]
