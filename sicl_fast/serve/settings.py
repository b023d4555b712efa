"""Server settings: the bind address, the API key and every cap a request is held to; their CLI flags.

No server package is imported here, so `sicl-fast serve --help` and the bind check work without the extra.
"""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
from dataclasses import dataclass

from ..errors import SiclError
from ..run.knobs import arg_type, check_range
from ..scheduler.limits import Limits

API_KEY_ENV = "SICL_FAST_API_KEY"


@dataclass(frozen=True)
class ServeSettings:
    """What the server allows. Every cap is checked before a request reaches the engine's queue."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no auth, and only a loopback bind (unless insecure_public)
    insecure_public: bool = False
    max_queue: int = 16  # requests waiting to join the batch (the scheduler's); more get 429
    max_batch_rows: int = 32  # answers decoding at once
    max_batch_tokens: int = 16384  # the K/V slots those answers hold
    max_batch_bytes: int | None = None  # bytes of the work in flight (None: a share of the memory available)
    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None  # prompt tokens (+ tokens to generate); None: the model's context only
    max_steps: int = 250  # the largest max_steps a request may ask for (also the default when lower than the preset)
    max_n: int = 64  # the largest N a request may ask for
    max_new_tokens: int = 256  # the largest max_new_tokens a request may ask for
    max_connections: int = 256  # HTTP requests in progress at once; the JSON 503 beyond it
    grace_s: float = 20.0  # on SIGTERM / SIGINT: the longest the work in flight may go on before the server exits
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.limits()  # the scheduler's limits, checked (max_queue >= 0, the batch's >= 1)
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise SiclError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name, knob in (("max_steps", "max_steps"), ("max_n", "N"), ("max_new_tokens", "max_new_tokens")):
            check_range(knob, getattr(self, name), "ServeSettings", f"--{name.replace('_', '-')}")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise SiclError(f"--grace-s must be a finite number >= 0, got {self.grace_s}")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise SiclError(f"--max-tokens must be >= 2, got {self.max_tokens}")
        if not 0 <= self.port < 65536:
            raise SiclError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise SiclError(f"the API key is empty (--api-key / {API_KEY_ENV})")


    def limits(self) -> Limits:
        """What the scheduler lets into the batch at once (sicl_fast.scheduler.Limits)."""
        return Limits(max_queue=self.max_queue, max_rows=self.max_batch_rows, max_tokens=self.max_batch_tokens,
                      max_bytes=self.max_batch_bytes)


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback addresses (127.0.0.0/8, ::1); False for names, 0.0.0.0, '' and the rest."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: ServeSettings) -> None:
    """Without an API key the server listens on loopback only, unless the operator insists (insecure_public)."""
    if settings.api_key is None and not settings.insecure_public and not is_loopback(settings.host):
        raise SiclError(
            f"refusing to listen on {settings.host!r} without an API key: set {API_KEY_ENV} (or --api-key), "
            "bind to 127.0.0.1, or pass --insecure-public"
        )


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's own flags (the model flags come from the CLI's shared group)."""
    d = ServeSettings()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=arg_type("port"), default=d.port, help=f"default {d.port}; 0: a free port")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the variable: "
                        "flags show up in the process list)")
    g.add_argument("--insecure-public", action="store_true",
                   help="allow a non-loopback --host without an API key")
    g.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--grace-s", type=float, default=d.grace_s, metavar="S",
                   help="on SIGTERM / SIGINT: new and waiting requests get 503; the work in flight may go on "
                        "for S seconds (answers to their stop; a calibration is stopped at 0.8 S and answers with "
                        "its best so far), then the server exits with status 0 (default "
                        f"{d.grace_s:g}; keep it below your orchestrator's kill timeout)")
    lim = p.add_argument_group("limits (a request over a limit gets a 4xx naming the field)")
    lim.add_argument("--max-queue", type=int, default=d.max_queue,
                     help="requests waiting to join the batch (the scheduler admits work in arrival order within "
                          "the --max-batch-* limits); beyond it: 429 + Retry-After")
    lim.add_argument("--max-batch-rows", type=int, default=d.max_batch_rows,
                     help="answers decoding together at once (every calibration's batch)")
    lim.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                     help="the K/V slots the answers in flight hold (each: its query's rows after the calibrated "
                          "prefix plus its max_tokens)")
    lim.add_argument("--max-batch-bytes", type=int, default=None,
                     help="bytes the work in flight holds: answers' K/V and logits, calibrations' steps, counted as "
                          "the step cache counts them (default: a share of the memory available at start)")
    lim.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    lim.add_argument("--max-tokens", type=int, default=None,
                     help="prompt tokens plus tokens to generate (default: the model's context)")
    lim.add_argument("--max-steps", type=arg_type("max_steps"), default=d.max_steps,
                     help="largest max_steps a request may ask for")
    lim.add_argument("--max-n", type=arg_type("N"), default=d.max_n, help="largest N a request may ask for")
    lim.add_argument("--max-new-tokens", type=arg_type("max_new_tokens"), default=d.max_new_tokens,
                     help="largest max_new_tokens a request may ask for")
    lim.add_argument("--max-connections", type=int, default=d.max_connections,
                     help="HTTP requests in progress at once (waiting for the engine included); beyond it: 503")


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """ServeSettings from parsed flags (the API key falls back to $SICL_FAST_API_KEY), bind rule checked."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    s = ServeSettings(host=args.host, port=args.port, api_key=key, insecure_public=args.insecure_public,
                      max_queue=args.max_queue, max_batch_rows=args.max_batch_rows,
                      max_batch_tokens=args.max_batch_tokens, max_batch_bytes=args.max_batch_bytes,
                      max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens,
                      max_steps=args.max_steps, max_n=args.max_n, max_new_tokens=args.max_new_tokens,
                      max_connections=args.max_connections, log_level=args.log_level,
                      grace_s=args.grace_s)
    check_bind(s)
    return s
