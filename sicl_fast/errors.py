"""Error types. Every error names what is wrong and where (request id, field, index)."""


class SiclError(ValueError):
    """Base class for every error sicl_fast raises on bad input."""


class RequestError(SiclError):
    """A request (prompt, spans, demos) is malformed. The message names the request id and field."""


class ModelLoadError(SiclError):
    """A model could not be found or loaded."""


class ContextLengthError(RequestError):
    """The prompt (plus tokens to generate) does not fit the model's context window."""


class NumericalError(SiclError):
    """NaN or inf appeared in embeddings or in the proxy."""
