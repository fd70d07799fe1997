"""A loopback TCP proxy that delays every byte it forwards: a slow remote, for real.

``DelayProxy(target_port).start()`` listens on a free loopback port and forwards
each accepted connection to ``127.0.0.1:target_port``. Bytes read in either
direction are written out ``delay_s`` seconds after they arrived (a latency, not
a bandwidth cap; ``rate_bytes_per_s`` adds one), so a client whose timeout is shorter than ``delay_s`` times
out while the server itself stays healthy. ``delay_s`` may change at any time;
bytes already queued keep the delay they were read under. Used by the slow-remote
reliability tests and the head-of-line and pipelined-load benchmarks in front of
``redis-server`` and the cache server.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

_READ_BYTES = 1 << 16
_EOF = b""


class DelayProxy:
    """Forwards ``127.0.0.1:port`` → ``127.0.0.1:target_port`` with ``delay_s`` of latency each way."""

    def __init__(self, target_port: int, delay_s: float = 0.0, rate_bytes_per_s: float | None = None) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        #: a bandwidth cap per direction of each connection (None: none), may change at any time
        self.rate_bytes_per_s = rate_bytes_per_s
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> DelayProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="delay-proxy-accept", daemon=True).start()
        return self

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the target is down: the client sees a closed connection
                continue
            with self._lock:
                if self._closed:  # accepted as close() ran: cut it as close() cut the rest
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                self._start_pipe(source, sink)

    def _start_pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """One direction: a reader stamps arrivals, a writer sends each piece once it is due."""
        pieces: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = source.recv(_READ_BYTES)
                except OSError:
                    data = _EOF
                pieces.put((time.monotonic() + self.delay_s, data))
                if data == _EOF:
                    return

        def write() -> None:
            while True:
                due, data = pieces.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if data == _EOF:
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                    return
                try:
                    self._send_paced(sink, data)
                except OSError:
                    return

        threading.Thread(target=read, name="delay-proxy-read", daemon=True).start()
        threading.Thread(target=write, name="delay-proxy-write", daemon=True).start()

    def _send_paced(self, sink: socket.socket, data: bytes) -> None:
        """Send ``data``, at most ``rate_bytes_per_s`` (in 4 KiB pieces) when a cap is set."""
        rate = self.rate_bytes_per_s
        if not rate:
            sink.sendall(data)
            return
        for first in range(0, len(data), 4096):
            piece = data[first : first + 4096]
            sink.sendall(piece)
            time.sleep(len(piece) / rate)

    def close(self) -> None:
        """Stop listening and cut every forwarded connection. Idempotent."""
        self._closed = True
        if self._listener is not None:
            # close() alone does not wake a thread blocked in accept() (its thread stayed,
            # one per proxy, for the process's life); shutdown() does
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
