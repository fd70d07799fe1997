"""The slow-remote proxy of the tests and benchmarks (``benchmarks/support/delay_proxy.py``)
forwards bytes, paces them when capped, and leaves no thread behind once closed: a suite
opens dozens of them in one process, and each thread it kept ran for the process's life."""

from __future__ import annotations

import socket
import threading
import time

from benchmarks.support.delay_proxy import DelayProxy
from tests.waiting import wait_until


def proxy_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("delay-proxy")}


def echo_server() -> socket.socket:
    """A loopback server that echoes what each connection sends until it closes."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def threads_left_after(before: set[threading.Thread]) -> list[str]:
    """The proxy threads started since ``before`` that still run after up to 5 s."""
    wait_until(lambda: not proxy_threads() - before, 5.0)
    return sorted(t.name for t in proxy_threads() - before)


def test_a_closed_proxy_leaves_no_thread_even_with_a_connection_accepted_while_closing():
    server = echo_server()
    before = proxy_threads()  # another test's proxies may still be closing: not this test's
    for round_number in range(20):
        with DelayProxy(server.getsockname()[1]) as proxy:
            client = socket.create_connection(("127.0.0.1", proxy.port))
            if round_number % 2:  # half the rounds: one message through, the rest: close at once
                client.sendall(b"ping")
                assert client.recv(16) == b"ping"
            client.close()
    assert threads_left_after(before) == []
    server.close()


def test_a_capped_proxy_paces_what_it_forwards():
    server = echo_server()
    before = proxy_threads()
    # 16 pieces of 4 KiB each way at 400 KB/s: the proxy sleeps ~10 ms after each, so the last
    # piece leaves at least 15 pieces' time after the first (a slower machine only adds to it)
    message = b"x" * (16 * 4096)
    rate = 400_000
    with DelayProxy(server.getsockname()[1], rate_bytes_per_s=rate) as proxy:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        started = time.perf_counter()
        client.sendall(message)
        received = b""
        while len(received) < len(message):
            received += client.recv(1 << 16)
        elapsed = time.perf_counter() - started
        client.close()
    assert received == message
    assert elapsed >= 15 * 4096 / rate, elapsed
    assert threads_left_after(before) == []
    server.close()
