"""The HTTP server's listening socket, taken before the model loads.

`kvstash serve` binds and listens on its port first: a port in use fails at once with one line
(not after the model has loaded, as uvicorn's own bind would), and no other server can take
the port while the model loads. Clients that connect meanwhile wait in the listen queue until
the API serves. uvicorn then serves on this socket.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable

import uvicorn

from cache_server.ports import PortInUseError, format_address

logger = logging.getLogger("uvicorn.error")


def listen_on(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (SO_REUSEADDR, as uvicorn binds:
    a port left in TIME_WAIT by a stopped server is free; a listening one is not).

    Raises PortInUseError when another process listens on the port, and OSError (with the
    address in its message) for any other bind failure."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError("port", host, port) from None
        raise OSError(exc.errno, f"cannot listen on {format_address(host, port)}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class _ServerOnSocket(uvicorn.Server):
    """uvicorn serving a socket it did not bind; logs uvicorn's usual "Uvicorn running on"
    line once it accepts requests (uvicorn itself is silent when given sockets)."""

    def __init__(
        self, config: uvicorn.Config, sock: socket.socket, on_started: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config)
        self._sock = sock
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self._sock.getsockname()[:2]
            scheme = "https" if self.config.is_ssl else "http"
            logger.info(
                "Uvicorn running on %s://%s (Press CTRL+C to quit)", scheme, format_address(host, port)
            )
            if self._on_started is not None:
                self._on_started()


def serve_on(sock: socket.socket, app, on_started: Callable[[], None] | None = None, **config_kwargs) -> None:
    """Serve `app` on the listening `sock` until SIGINT/SIGTERM (blocking); closes `sock`.
    `on_started` is called once the server accepts requests."""
    config = uvicorn.Config(app, **config_kwargs)
    _ServerOnSocket(config, sock, on_started).run(sockets=[sock])
