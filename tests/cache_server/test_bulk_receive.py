"""``protos.bulk_wire.recv_exactly(wait_all=True)``: a client receives a value of megabytes in
one system call on a blocking socket (the GIL taken back once, not per socket buffer), and
still ends with the errors a receive must give: a peer that closes, a peer that stalls."""

from __future__ import annotations

import socket
import threading

import pytest

from protos.bulk_wire import recv_exactly, timeval, tune_unix_socket

MIB = 1 << 20


class CountingSocket:
    """A socket whose ``recv_into`` calls (and the flags they passed) are recorded."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.flags: list[int] = []

    def gettimeout(self) -> float | None:
        return self.sock.gettimeout()

    def recv_into(self, view, num_bytes: int = 0, flags: int = 0) -> int:
        self.flags.append(flags)
        return self.sock.recv_into(view, num_bytes, flags)


@pytest.fixture
def pair():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in (left, right):
        tune_unix_socket(sock)
    yield left, right
    left.close()
    right.close()


def send_later(sock: socket.socket, data: bytes, close: bool = False) -> threading.Thread:
    def send() -> None:
        sock.sendall(data)
        if close:
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_value_of_megabytes_is_one_call_on_a_blocking_socket(pair) -> None:
    receiver, sender = pair
    data = bytes(range(256)) * (8 * MIB // 256)
    sender_thread = send_later(sender, data)
    counted = CountingSocket(receiver)
    view = memoryview(bytearray(len(data)))
    recv_exactly(counted, view, wait_all=True)
    sender_thread.join()
    assert view == data
    assert set(counted.flags) == {socket.MSG_WAITALL}
    assert len(counted.flags) <= 2  # one, unless a signal cut the wait short


def test_without_wait_all_each_call_returns_what_the_socket_buffer_held(pair) -> None:
    receiver, sender = pair
    data = bytes(8 * MIB)
    sender_thread = send_later(sender, data)
    counted = CountingSocket(receiver)
    recv_exactly(counted, memoryview(bytearray(len(data))))
    sender_thread.join()
    assert set(counted.flags) == {0} and len(counted.flags) > 2


def test_a_socket_with_a_python_timeout_gets_no_flag(pair) -> None:
    receiver, sender = pair
    receiver.settimeout(10)
    sender_thread = send_later(sender, b"x" * MIB)
    counted = CountingSocket(receiver)
    view = memoryview(bytearray(MIB))
    recv_exactly(counted, view, wait_all=True)
    sender_thread.join()
    assert view == b"x" * MIB and set(counted.flags) == {0}


def test_a_peer_that_closes_midway_is_a_connection_error(pair) -> None:
    receiver, sender = pair
    send_later(sender, b"y" * 1000, close=True).join()
    with pytest.raises(ConnectionError, match="after 1000 of 4096 bytes"):
        recv_exactly(receiver, memoryview(bytearray(4096)), wait_all=True)


def test_a_peer_that_stalls_midway_ends_at_the_kernel_timeout(pair) -> None:
    receiver, sender = pair
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(0.2))
    sender.sendall(b"z" * 1000)
    # the bulk client turns this into its TimeoutError (bulk_channel._as_timeout)
    with pytest.raises(BlockingIOError):
        recv_exactly(receiver, memoryview(bytearray(MIB)), wait_all=True)
