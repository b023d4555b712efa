"""Running the app on uvicorn: `serve` (the CLI, blocking) and `ServerThread` (tests, benchmarks, embedding)."""
from __future__ import annotations

import socket
import sys
import threading
import time

import uvicorn

from ..errors import SiclError
from .app import create_app
from .settings import ServeSettings, check_bind


def uvicorn_config(app, settings: ServeSettings, log_level: str | None = None) -> uvicorn.Config:
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level or settings.log_level,
                          limit_concurrency=settings.max_connections, timeout_graceful_shutdown=5,
                          server_header=False)


def serve(engine, settings: ServeSettings) -> int:
    """Serve until interrupted. Ctrl-C (SIGINT) returns 0 after a graceful shutdown; on SIGTERM uvicorn shuts
    down gracefully and then lets the signal end the process (exit status -15 / 143). The bind rule is checked
    before anything listens."""
    check_bind(settings)
    app = create_app(engine, settings)
    auth = "API key required" if settings.api_key else "no API key"
    print(f"sicl-fast serve: model {engine.lm.name} ({engine.backend.name} backend), http://{settings.host}:"
          f"{settings.port} ({auth}; docs at /docs)", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, settings)).run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises Ctrl-C: exit quietly
        pass
    return 0


class ServerThread:
    """The real server on a background thread, listening on its own socket (port 0: a free port).

        with ServerThread(engine, ServeSettings(port=0)) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, engine, settings: ServeSettings | None = None, log_level: str = "warning") -> None:
        self.settings = settings or ServeSettings(port=0)
        check_bind(self.settings)
        self.app = create_app(engine, self.settings)
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.settings.host, self.settings.port))
        self.server = uvicorn.Server(uvicorn_config(self.app, self.settings, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="sicl-fast-serve")

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise SiclError("the server thread did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
