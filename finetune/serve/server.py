"""Start `finetune serve`: bind the socket, load the models, run uvicorn; in the foreground or in a thread.

The socket is bound before the models load, so a taken port fails at once, and `port=0` works (the
port is chosen by the OS and reported). `serve_forever` is the CLI's: it runs until Ctrl-C/SIGTERM.
`ServerThread` runs the same stack in a background thread, for tests and benchmarks.

Example:
    with ServerThread(ServeSettings(base="models/tiny", adapters={"legal": "adapters/legal"}, port=0)) as server:
        httpx.get(server.url + "/v1/models")
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time

from finetune.errors import ServeError
from finetune.serve.settings import ServeSettings

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
        try:
            import fastapi  # noqa: F401
            import uvicorn
        except ImportError as exc:
            raise ServeError(f"finetune serve needs {exc.name}: pip install 'finetune[serve]'") from None

        from finetune.serve.app import create_app
        from finetune.serve.batcher import Batcher
        from finetune.serve.engine import Engine

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
        """Serve in this thread until uvicorn is told to exit (Ctrl-C / SIGTERM in the main thread)."""
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

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(settings: ServeSettings) -> None:
    """The CLI's server: print where it listens, then serve until interrupted."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    server = ServerThread(settings)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(
            f"warning: listening on {settings.host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    names = ", ".join(card.id for card in server.engine.models())
    mode = f" (merged: {server.engine.merged})" if server.engine.merged else ""
    print(f"finetune serve: {server.url}/v1 serving {names}{mode}", file=sys.stderr, flush=True)
    server.run()
