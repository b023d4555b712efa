"""ICLEval benchmark support (following the project's ICLEval notes, SPEC.md): load the 13 task files, render
prompts with the character span of every demonstrated output, and score greedy responses with ICLEval's rules.

    samples = load_dir("ICLEval/data/tasks_data")           # {file name without .json: [Sample, ...]}
    req = to_request(samples["classifier_order"][0])         # Request with output spans, id "classifier_order:0"
    ... greedy-decode at most max_gen_len(s) tokens, optionally stopping once should_stop(s, text) ...
    ok = score(s, response_text)
"""
from .convert import request_id, to_request, tokenize_sample
from .errors import ICLEvalDataWarning, ICLEvalError
from .loader import Sample, load_dir, load_task
from .render import Rendered, render
from .scoring import cut_strings, max_gen_len, score, should_stop
from .tasks import SHA256, TASK_FILES, TASKS, TaskSpec, get_task

__all__ = [
    "load_task", "load_dir", "render", "to_request", "score", "max_gen_len", "cut_strings", "should_stop",
    "TASK_FILES", "Sample",
    # extras
    "Rendered", "TaskSpec", "TASKS", "SHA256", "get_task", "request_id", "tokenize_sample",
    "ICLEvalError", "ICLEvalDataWarning",
]
