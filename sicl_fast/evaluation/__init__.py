"""The paper's analysis from one command: methods (base, sicl, cc, dcpmi, demo), ablations, tests, report.

    from sicl_fast.evaluation import run_methods, make_variants, report_from_files
    recs = run_methods(engine, "ICLEval/data/tasks_data", "results.jsonl", methods=["base", "sicl", "cc"],
                       config=engine.config(max_steps=50), tasks=["classifier_order"], limit=20)
    report_from_files(["results.jsonl"], "RUN/")       # RUN/report.md, RUN/report.json, RUN/plots/*.png

Modules: stats (McNemar, Spearman, Fisher), report (tables, tests, report files), plots (figures),
label_scoring (log p(label | prompt) with prefix caching), baselines (CC, DC-PMI, DEmO on plain texts),
icleval_cls (ICLEval's classification files: labels, content-free queries, premises, demonstration blocks),
methods (the runner writing per-sample records), ablations (calibration variants), cli (argparse glue).
"""
from .ablations import Variant, drop_component, make_variants, variant_name
from .baselines import calibrate_probs, contextual_calibration, dc_pmi, demo_select
from .label_scoring import LabelScorer
from .methods import BASELINES, METHODS, BaselineOptions, run_methods
from .report import Run, build_report, load_runs, render_markdown, report_from_files, write_report
from .stats import fisher_combined, mcnemar_exact, spearman_one_sided

__all__ = [
    "Variant", "drop_component", "make_variants", "variant_name", "calibrate_probs", "contextual_calibration",
    "dc_pmi", "demo_select", "LabelScorer", "BASELINES", "METHODS", "BaselineOptions", "run_methods", "Run",
    "build_report", "load_runs", "render_markdown", "report_from_files", "write_report", "fisher_combined",
    "mcnemar_exact", "spearman_one_sided",
]
