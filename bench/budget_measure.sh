#!/usr/bin/env bash
# Issue 31's measurement: what min_delta and a time budget cost and change, on SmolLM2 (the embedded default) and
# three ICLEval files, 20 samples each, one results file per stopping rule, then the report that compares them.
# The files: the three with the shortest prompts for SmolLM2 (mean 216, 259 and 325 tokens over their first 20
# samples; the others hold 660 to 1700), so that the paper's rule, which runs up to 250 steps a sample, stays
# within hours on a CPU.
#
#   paper.jsonl      the paper's rule (patience 5 on any gain, K = 250), the answer also decoded after
#                    1 2 5 10 20 50 100 250 steps (the report's "answers changed vs steps" and the budget curves)
#   min_delta.jsonl  --min-delta 1e-3 (patience counts only gains of more than 1e-3 over the last counted one)
#   budget2s.jsonl   --time-budget 2 (each calibration stops at its first step boundary after 2 s)
#   report/          report.md: per run seconds per sample and answers changed (per task), the budget curves of
#                    each run, and "Runs compared with paper": answers that differ, steps and seconds, stop reasons
#
# Run it on a quiet machine (it records `uptime` before each run) from the repository root:
#
#   bash bench/budget_measure.sh                                   # the measurement
#   LIMIT=1 EXTRA="--max-steps 2" OUT=/tmp/b bash bench/budget_measure.sh        # a smoke test of the commands
#
# Environment: DATA (ICLEval task files; default $SICL_ICLEVAL_DIR, else ICLEval/data/tasks_data: the clone of
# `git clone https://github.com/RUCBM/ICLEval`, as README.md's evaluation section makes it), OUT (default
# bench/budget_run), LIMIT (samples per file, default 20), TASKS, EXTRA (more icleval flags, e.g. --model DIR
# --max-steps 2), SICL (the command; default .venv/bin/sicl-fast where `make` set it up, else sicl-fast from PATH).
# A run that is interrupted resumes when started again.
set -euo pipefail

DATA=${DATA:-${SICL_ICLEVAL_DIR:-ICLEval/data/tasks_data}}
OUT=${OUT:-bench/budget_run}
LIMIT=${LIMIT:-20}
TASKS=${TASKS:-generate_format_conversion generate_order classifier_order}
EXTRA=${EXTRA:-}
if [ -z "${SICL:-}" ]; then
    if [ -x .venv/bin/sicl-fast ]; then SICL=.venv/bin/sicl-fast; else SICL=sicl-fast; fi
fi
if ! compgen -G "$DATA/*.json" > /dev/null; then  # before any run: not three failures, one line
    echo "budget_measure.sh: no ICLEval task files (*.json) in $DATA: run \`git clone" \
         "https://github.com/RUCBM/ICLEval\` in $(pwd), or set DATA to the folder that holds them" >&2
    exit 2
fi

mkdir -p "$OUT"
run() {  # run NAME FLAGS...: one icleval results file
    local name=$1
    shift
    echo "$name: $(uptime)" | tee -a "$OUT/load.txt"
    # shellcheck disable=SC2086  # TASKS, EXTRA and SICL are word lists
    $SICL icleval "$DATA" --tasks $TASKS --limit "$LIMIT" --out "$OUT/$name.jsonl" --quiet $EXTRA "$@" > /dev/null
}

run paper --answer-at 1 2 5 10 20 50 100 250
run min_delta --min-delta 1e-3
run budget2s --time-budget 2
# shellcheck disable=SC2086
$SICL report "$OUT/paper.jsonl" "$OUT/min_delta.jsonl" "$OUT/budget2s.jsonl" \
    --names paper min_delta=1e-3 budget=2s --report "$OUT/report" > /dev/null
echo "report: $OUT/report/report.md"
