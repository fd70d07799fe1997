"""Ports that belong to one server: a second server on a taken port is refused.

gRPC binds its ports with SO_REUSEPORT unless a server option says otherwise, so a second
cache server started on a taken port used to listen there too and the kernel split new
connections between the two processes (two caches behind one address). The servers here turn
that off (``SERVER_OPTIONS``) and say which port is taken before gRPC's own, vaguer, error.
"""

from __future__ import annotations

import contextlib
import errno
import socket

#: gRPC server options: bind without SO_REUSEPORT (the port is this process's alone)
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class PortInUseError(OSError):
    """A port another process listens on (errno EADDRINUSE); the message names it."""

    def __init__(self, what: str, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"{what} {format_address(host, port)} is already in use by another process "
            "(stop it or choose another port)",
        )

    def __str__(self) -> str:
        return self.strerror


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(what: str, host: str, port: int) -> None:
    """Raise :class:`PortInUseError` when a TCP listener holds `port` on `host`.

    Binds a probe socket with SO_REUSEADDR, as the servers' own sockets do, so a port whose old
    connections are still in TIME_WAIT after a restart counts as free; port 0 is always free.
    Other bind errors (an address not on this host, ...) are left to the real bind to report.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, sock_type, proto, _, address in infos:
        with contextlib.closing(socket.socket(family, sock_type, proto)) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(what, host, port) from None
