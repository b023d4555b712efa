"""Running the app on uvicorn: `serve` (the CLI, blocking) and `ServerThread` (tests, benchmarks, embedding).

`Server` is uvicorn's server with the drain of shutdown.py on SIGTERM and SIGINT in place of uvicorn's own
shutdown (which cancels requests still running after a few seconds and answers them in plain text): it exits with
status 0 once nothing is in flight or the grace period is over.
"""
from __future__ import annotations

import copy
import errno
import logging
import os
import socket
import sys
import threading
import time

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from ..errors import SiclError
from .app import create_app
from .settings import ServeSettings, check_bind

log = logging.getLogger("sicl_fast.serve")

WRITE_WAIT_S = 2.0  # once the drain is over: how long uvicorn waits for the last replies to be written


def log_config(level: str) -> dict:
    """uvicorn's logging, plus the server's own logger (one line per request, errors, shutdown) at `level`."""
    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["sicl_fast.serve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def uvicorn_config(app, settings: ServeSettings, log_level: str | None = None) -> uvicorn.Config:
    level = log_level or settings.log_level
    # no access log: RequestMetrics logs every request, with more in its line; no limit_concurrency: uvicorn answers
    # it in plain text, overload.py in JSON
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=level, log_config=log_config(level),
                          access_log=False, timeout_graceful_shutdown=WRITE_WAIT_S, server_header=False)


class Server(uvicorn.Server):
    """uvicorn.Server whose SIGTERM / SIGINT start the app's drain (shutdown.py); it exits when the drain ends."""

    def __init__(self, app, log_level: str | None = None) -> None:
        super().__init__(uvicorn_config(app, app.state.serve.settings, log_level))
        self.drain = app.state.serve.shutdown

    def handle_exit(self, sig, frame) -> None:  # a signal handler: note it, act on the next tick
        if self.should_exit:
            self.force_exit = True  # a signal while the last replies are written: stop waiting for them
        self.drain.request()

    async def on_tick(self, counter: int) -> bool:
        if self.drain.tick():
            self.should_exit = True
        return await super().on_tick(counter)


def bind(settings: ServeSettings) -> socket.socket:
    """The server's socket, listening on --host and --port (the bind rule checked first): a port in use, an address
    this machine does not have or a port it may not take is one line (a SiclError), before the model loads;
    connections wait in its backlog until the server runs."""
    check_bind(settings)
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
        sock.listen(2048)  # held from here (two servers bound but not listening could share the port)
    except OSError as exc:
        sock.close()
        why = "in use (another server?)" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise SiclError(f"cannot listen on {settings.host}:{settings.port}: {why}; choose another --port or --host"
                        ) from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(engine, settings: ServeSettings, sock: socket.socket | None = None) -> int:
    """Serve on `sock` (default: bind(settings)) until SIGTERM or SIGINT, then drain (shutdown.py) and return 0. A
    request still in flight past the grace period ends with the process: os._exit(0) without the interpreter's
    finalization, which would abort the process inside that request's torch call (Scheduler.ended)."""
    sock = sock if sock is not None else bind(settings)
    app = create_app(engine, settings)
    auth = "API key required" if settings.api_key else "no API key"
    print(f"sicl-fast serve: model {engine.lm.name} ({engine.backend.name} backend), {url_of(sock)} ({auth}; docs "
          "at /docs)", file=sys.stderr, flush=True)
    Server(app).run(sockets=[sock])
    if not app.state.serve.scheduler.ended:
        log.info("exiting with the work that ran past the grace period still inside the engine (its reply was the "
                 "503)")
        logging.shutdown()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    return 0


class ServerThread:
    """The real server on a background thread, listening on its own socket (port 0: a free port).

        with ServerThread(engine, ServeSettings(port=0)) as srv:
            httpx.get(srv.url + "/health")

    `shutdown()` drains as SIGTERM does; leaving the block stops it at once (the work in flight is cancelled).
    """

    def __init__(self, engine, settings: ServeSettings | None = None, log_level: str = "warning") -> None:
        self.settings = settings or ServeSettings(port=0)
        self.sock = bind(self.settings)
        self.app = create_app(engine, self.settings)
        self.server = Server(self.app, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="sicl-fast-serve")

    @property
    def url(self) -> str:
        return url_of(self.sock)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise SiclError("the server thread did not start")
            time.sleep(0.01)
        return self

    def shutdown(self, timeout: float = 60.0) -> None:
        """What SIGTERM does to `sicl-fast serve` (shutdown.py); returns once the server has exited."""
        self.server.drain.request()
        self.thread.join(timeout)
        self.sock.close()

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
