"""Client of `sicl-fast serve` (httpx, from the `serve` extra).

    from sicl_fast.serve.client import Client
    with Client("http://127.0.0.1:8000", api_key=None) as c:
        c.proxy({"id": "q1", "demos": [...], "query": "five"})["proxy"]
        r = c.calibrate({...}, max_steps=20, generate=True, return_embeddings=True)
        r["summary"]["best_proxy"], r["answers"]["calibrated"]
        r["embeddings"]                 # CalibratedEmbeddings: .rows [b - a, d] tensor, .row_start, .row_end, .save()

An error reply raises ServerError (status, kind, message); a full queue raises QueueFullError with retry_after.
"""
from __future__ import annotations

import email.utils
import math
import time
from typing import Any

from ..errors import SiclError
from ..answering.export import CalibratedEmbeddings


class ServerError(SiclError):
    """An error reply from the server: status (HTTP), kind (e.g. 'invalid_request', 'limit'), message."""

    def __init__(self, status: int, kind: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"HTTP {status} {kind}: {message}")
        self.status, self.kind, self.message, self.request_id = status, kind, message, request_id


class QueueFullError(ServerError):
    """429: the server's queue is full; retry after `retry_after` seconds."""

    def __init__(self, status, kind, message, request_id=None, retry_after: float = 1.0) -> None:
        super().__init__(status, kind, message, request_id)
        self.retry_after = retry_after


def retry_after(value: str | None, now: float | None = None) -> float:
    """The seconds a Retry-After header asks for: a number of seconds, or an HTTP date (RFC 9110 allows both; a proxy
    in front of the server may send the date), at least 0; 1 when there is none or it reads as neither (a 429 is
    answered with the wait it asks for, never with a ValueError of the header)."""
    if value is None:
        return 1.0
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError, IndexError, OverflowError):
            return 1.0
    return max(0.0, seconds) if math.isfinite(seconds) else 1.0


class Client:
    """url: the server's base URL; api_key: sent as 'Authorization: Bearer'; timeout: seconds per HTTP call
    (None: wait as long as the calibration takes). Thread-safe (one pooled httpx.Client)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float | None = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    # --- plumbing ---
    def _call(self, method: str, path: str, body: dict | None = None):
        r = self._http.request(method, path, json=body)
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                kind, message = err["kind"], err["message"]
            except (ValueError, KeyError, TypeError):
                kind, message = "http", r.text[:200]
            rid = r.headers.get("x-request-id")
            if r.status_code == 429:
                raise QueueFullError(429, kind, message, rid, retry_after(r.headers.get("retry-after")))
            raise ServerError(r.status_code, kind, message, rid)
        return r

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- endpoints ---
    def health(self) -> dict:
        return self._call("GET", "/health").json()

    def models(self) -> list[dict]:
        return self._call("GET", "/v1/models").json()["data"]

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text

    def proxy(self, request: dict, **knobs: Any) -> dict:
        """f, C, R, G, c, token spans of one request (either JSON form); knobs: alpha, beta, gamma, q."""
        return self._call("POST", "/v1/proxy", {"request": request, "config": knobs or None}).json()

    def calibrate(self, request: dict, *, generate: bool = False, max_new_tokens: int | None = None,
                  stop: list[str] | None = None, return_embeddings: bool = False, embeddings_dtype: str = "float32",
                  embeddings_rows: str = "demos", timeout_s: float | None = None,
                  time_budget_s: float | None = None, **knobs: Any) -> dict:
        """Calibrate one request. knobs: any CalibrationConfig field (max_steps=20, N=8, seed=1, ...).
        timeout_s: a deadline from arrival (queueing included); time_budget_s: seconds of calibration.
        With return_embeddings, reply["embeddings"] is a CalibratedEmbeddings (decoded bit for bit)."""
        body: dict[str, Any] = {"request": request, "config": knobs or None, "generate": generate,
                                "return_embeddings": return_embeddings, "embeddings_dtype": embeddings_dtype,
                                "embeddings_rows": embeddings_rows}
        for name, value in (("max_new_tokens", max_new_tokens), ("stop", stop), ("timeout_s", timeout_s),
                            ("time_budget_s", time_budget_s)):
            if value is not None:
                body[name] = value
        reply = self._call("POST", "/v1/calibrate", body).json()
        if "embeddings" in reply:
            reply["embeddings"] = CalibratedEmbeddings.from_json(reply["embeddings"])
        return reply


__all__ = ["Client", "ServerError", "QueueFullError"]
