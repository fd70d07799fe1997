"""The control channel between the engine's process (node 0) and the processes that
run on other hosts: a TCP connection each, at node 0's `--dist-init-addr` PORT + 1,
carrying the same pickled messages (`multiprocessing.connection.Connection`) that the
processes node 0 starts itself get through a pipe: their spec, plans, replies, stop.
A connection's end (EOF) tells that its peer is gone, as a pipe's does.

Whoever connects says who it is first (`Hello`): one node connection per other host
(its launch, which watches its rank processes) and one per rank process. Like
torch.distributed's own store at PORT, the channel trusts its network: run the nodes
on a private one.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import socket
import time
from typing import NamedTuple

#: a connection's first message starts with this (a stray client is refused)
MAGIC = "kvstash-node-v1"
#: how often a node retries reaching node 0 while it waits for it
CONNECT_RETRY_S = 0.2


class Hello(NamedTuple):
    """A connecting process: `process_index` None for a node's launch."""

    magic: str
    node_rank: int
    process_index: int | None
    world_size: int
    nnodes: int
    tensor_parallel_size: int


class NodeError(RuntimeError):
    """A node after the first: node 0 stopped on an error or went away, or one of the
    node's own processes died (engine.pipeline.node)."""


class NodeStartError(NodeError):
    """Node 0 or another node did not come, or disagreed on the layout, in time."""


class ControlListener:
    """Node 0's listening socket, open from before its stage processes start until every
    other node's processes connected (`accept_all`)."""

    def __init__(self, host: str, port: int) -> None:
        try:
            self._socket = socket.create_server((host, port), family=_family(host), backlog=64)
        except OSError as error:
            raise NodeStartError(
                f"node 0 cannot listen on {host}:{port} (--dist-init-addr PORT + 1): {error}"
            ) from None

    def accept_all(
        self, world_size: int, nnodes: int, tp_size: int, remote_indices: range, deadline: float
    ) -> tuple[
        dict[int, multiprocessing.connection.Connection], dict[int, multiprocessing.connection.Connection]
    ]:
        """Accept until every other node's launch and every process in `remote_indices`
        said hello -> (node rank -> connection, process index -> connection). Each is told
        ("ok", None), or ("error", why) and dropped when its layout differs from node 0's.
        NodeStartError names who is missing at `deadline` (time.monotonic)."""
        node_conns: dict[int, multiprocessing.connection.Connection] = {}
        process_conns: dict[int, multiprocessing.connection.Connection] = {}
        expected_nodes = set(range(1, nnodes))
        while set(node_conns) != expected_nodes or set(process_conns) != set(remote_indices):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expected_nodes - set(node_conns))
                raise NodeStartError(
                    f"node(s) {missing or 'all came, but processes'} "
                    f"{sorted(set(remote_indices) - set(process_conns))} did not connect to node 0 in "
                    "time (dist_init_timeout): start every node with the same --nnodes, "
                    "--dist-init-addr and parallel sizes, each with its own --node-rank"
                )
            self._socket.settimeout(min(left, 1.0))
            try:
                sock, _ = self._socket.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            conn = multiprocessing.connection.Connection(sock.detach())
            hello = _read_hello(conn, min(left, 10.0))
            problem = _layout_problem(hello, (world_size, nnodes, tp_size), remote_indices)
            if problem is None:
                target = node_conns if hello.process_index is None else process_conns
                key = hello.node_rank if hello.process_index is None else hello.process_index
                if key in target:
                    problem = f"node {hello.node_rank} connected twice (two launches with one --node-rank?)"
            if problem is not None:
                with contextlib.suppress(OSError):
                    conn.send(("error", problem))
                conn.close()
                raise NodeStartError(problem)
            conn.send(("ok", None))
            target[key] = conn
        return node_conns, process_conns

    def close(self) -> None:
        self._socket.close()


def connect(
    host: str, port: int, hello: Hello, timeout_s: float
) -> tuple[multiprocessing.connection.Connection, str]:
    """A process on another node reaches node 0 -> (connection, the local address that
    routes to node 0: its gloo interface). Retries until node 0 listens; NodeStartError
    when it did not within `timeout_s` or refused the hello."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as error:
            if time.monotonic() + CONNECT_RETRY_S > deadline:
                raise NodeStartError(
                    f"node {hello.node_rank}: no engine answered at {host}:{port} (node 0's "
                    f"--dist-init-addr PORT + 1) within {timeout_s:g} s ({error}); start node 0 "
                    "with the same --dist-init-addr and --nnodes"
                ) from None
            time.sleep(CONNECT_RETRY_S)
    sock.settimeout(None)
    local_host = sock.getsockname()[0]
    conn = multiprocessing.connection.Connection(sock.detach())
    conn.send(hello)
    if not conn.poll(max(1.0, deadline - time.monotonic())):
        conn.close()
        raise NodeStartError(f"node {hello.node_rank}: node 0 at {host}:{port} did not answer its hello")
    try:
        status, problem = conn.recv()
    except EOFError:
        raise NodeStartError(
            f"node {hello.node_rank}: node 0 at {host}:{port} closed the connection"
        ) from None
    if status != "ok":
        conn.close()
        raise NodeStartError(f"node {hello.node_rank}: node 0 refused it: {problem}")
    return conn, local_host


def _read_hello(conn: multiprocessing.connection.Connection, timeout_s: float) -> Hello | None:
    try:
        if conn.poll(timeout_s):
            message = conn.recv()
            if isinstance(message, Hello) and message.magic == MAGIC:
                return message
    except Exception:  # noqa: BLE001 - a stray client sent anything
        return None
    return None


def _layout_problem(hello: Hello | None, layout: tuple[int, int, int], remote_indices: range) -> str | None:
    """Why `hello` does not fit node 0's (processes, nodes, tensor-parallel size), or None."""
    if hello is None:
        return "a client at the control port did not introduce itself as a kvstash node"
    world_size, nnodes, tp_size = layout
    if (hello.world_size, hello.nnodes, hello.tensor_parallel_size) != layout:
        return (
            f"node {hello.node_rank} runs {hello.world_size} processes ({hello.tensor_parallel_size} per stage) "
            f"over {hello.nnodes} nodes, node 0 {world_size} ({tp_size} per stage) over {nnodes}: give every "
            "node the same --nnodes and parallel sizes"
        )
    if not 1 <= hello.node_rank < nnodes:
        return f"node rank {hello.node_rank} is not one of 1..{nnodes - 1}"
    if hello.process_index is not None and hello.process_index not in remote_indices:
        return f"process {hello.process_index} is not one of another node's"
    return None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
