"""Start `finetune serve`: bind the socket, load the models, run uvicorn; in the foreground or in a thread.

The socket is bound before the models load, so a taken port fails at once, and `port=0` works (the
port is chosen by the OS and reported). `ServerThread` runs the whole stack in a background thread, for
tests and benchmarks; `serve_forever`, the CLI's, runs one too while the main thread waits for SIGINT or
SIGTERM, so that the exit status is ours, 128 + the signal, whenever the signal comes (`finetune.signals`).

Example:
    with ServerThread(ServeSettings(base="models/tiny", adapters={"legal": "adapters/legal"}, port=0)) as server:
        httpx.get(server.url + "/v1/models")
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import uvicorn

from finetune.errors import ServeError
from finetune.serve.app import create_app
from finetune.serve.batcher import Batcher
from finetune.serve.engine import Engine
from finetune.serve.settings import ServeSettings
from finetune.signals import StopRequest, first_signal_stops

logger = logging.getLogger("finetune.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6, as the host resolves); ServeError if it cannot be."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise ServeError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --host/--port"
        ) from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ServerThread:
    """The whole server (models, batcher, uvicorn) running in a background thread until `stop()`."""

    def __init__(self, settings: ServeSettings):
        settings.check()
        self.socket = bind(settings.host, settings.port)
        try:
            self.engine = Engine.load(settings)
        except BaseException:
            self.socket.close()
            raise
        self.batcher = Batcher(
            self.engine,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
            max_pending=settings.max_pending,
        )
        app = create_app(self.batcher, max_tokens_limit=settings.max_tokens_limit, api_key=settings.api_key)
        config = uvicorn.Config(app, log_level=settings.log_level, access_log=settings.log_level in ("info", "debug"))
        self.server = uvicorn.Server(config)
        self.url = url_of(self.socket)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Serve in this thread until `stop()`. In a thread other than the main one uvicorn installs no
        signal handlers of its own (it may only there), so signals stay with whoever started it."""
        self.batcher.start()
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.batcher.stop()
            self.socket.close()

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        """Serve in a background thread; return once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="finetune-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise RuntimeError("finetune serve did not start; see the log above")
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, grace_s: float = 10.0) -> None:
        """Shut uvicorn down gracefully: open requests get `grace_s` to finish, then whatever still generates
        fails with 503 "shutting down" (streams get an error event and [DONE]), and the thread ends.

        uvicorn waits for open requests without limit, and they wait for the batcher, which `run` stopped only
        after uvicorn returned: a long generation held the shutdown until a 30 s join gave up, and the process
        then exited with the HTTP and worker threads still running (SIGABRT, 134, not 130)."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(grace_s)
            if self._thread.is_alive():
                self.batcher.stop()
                self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(settings: ServeSettings) -> int:
    """The CLI's server: load, print where it listens, serve until SIGINT/SIGTERM.

    A signal during the load stops the server once the models are loaded (`finetune.signals`: a
    KeyboardInterrupt raised into the load, as Python's default handler does, that passed through an `exec`
    of source text, as dataclasses build methods, made CPython end killed by SIGINT (-2), not with 130).
    Not uvicorn's own handling either: it installs its handlers only once it runs, and after its graceful
    shutdown restores the handler it found and re-raises the signal into it, so the status was whatever
    that handler made of it: 0 in a process started with SIGINT ignored, where a signal that came before
    uvicorn ran was lost and the server never stopped.

    Returns:
        The exit status: 128 + the signal that stopped it (130 for Ctrl-C), whether it came while the
        models loaded or while serving.
    """
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    with first_signal_stops(_announce) as stop:
        print(f"loading {_models_to_load(settings)} ...", file=sys.stderr, flush=True)
        server = ServerThread(settings)
        if stop.signal_number is None:
            _serve_until_stopped(server, settings, stop)
    assert stop.signal_number is not None  # serving ends only by a signal
    return 128 + stop.signal_number


def _announce(signal_name: str) -> None:
    # os.write, not print: the main thread may be inside a write to sys.stderr's buffer right now
    os.write(2, f"{signal_name}: stopping (send it again to stop at once)\n".encode())


def _models_to_load(settings: ServeSettings) -> str:
    base = settings.base or "the adapters' base"
    return f"{base} and adapters {', '.join(settings.adapters)}" if settings.adapters else base


def _serve_until_stopped(server: ServerThread, settings: ServeSettings, stop: StopRequest) -> None:
    """Serve in a background thread and say where; shut it down gracefully once a signal came."""
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(
            f"warning: listening on {settings.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    server.start()
    names = ", ".join(card.id for card in server.engine.models())
    mode = f" (merged: {server.engine.merged})" if server.engine.merged else ""
    print(f"finetune serve: {server.url}/v1 serving {names}{mode}", file=sys.stderr, flush=True)
    while stop.signal_number is None and server.running:
        time.sleep(0.1)  # the signal handler only records; a sleep is interrupted by it and resumes
    if stop.signal_number is None:
        raise RuntimeError("the HTTP server stopped by itself; see the log above")
    server.stop()
