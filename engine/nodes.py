"""Ranks that span hosts (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`, as
SGLang's flags): which processes each host runs, and the two addresses derived from
HOST:PORT. Pure functions: `EngineArgs.validate` checks the flags with them before
anything starts, the pipeline executor (node 0) and `engine.pipeline.node` (the
other nodes) lay out the processes with them.

The world is the engine's tensor_parallel_size × pipeline_parallel_size processes,
numbered stage-major (process p runs stage p // TP, rank p % TP); node R runs the
processes [R·k, (R+1)·k) with k = world / nnodes. Node 0's first process is the
engine's own (it schedules and serves)."""

from __future__ import annotations

import ipaddress
from typing import NamedTuple


class NodeAddress(NamedTuple):
    """Where node 0 listens: torch.distributed's store on `port`, the control channel to
    the other nodes' processes (plans, replies, liveness) on `control_port`."""

    host: str
    port: int

    @property
    def control_port(self) -> int:
        return self.port + 1


def parse_dist_init_addr(address: str) -> NodeAddress:
    """'HOST:PORT' (an IPv6 host in brackets: '[::1]:PORT') -> NodeAddress; ValueError
    naming the address when it is not one."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"dist_init_addr must be HOST:PORT (node 0's address), got {address!r}")
    port = int(port_text)
    if not 1 <= port <= 65534:  # PORT + 1 must be a port too
        raise ValueError(f"dist_init_addr's port must be in 1..65534 (PORT + 1 is used too), got {port}")
    return NodeAddress(host, port)


def check_nodes(
    nnodes: int, node_rank: int, dist_init_addr: str | None, world_size: int, timeout_s: float
) -> None:
    """Raise ValueError naming the first bad flag (called by `EngineArgs.validate`)."""
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1} (nnodes {nnodes}), got {node_rank!r}")
    if not timeout_s > 0:
        raise ValueError(f"dist_init_timeout must be > 0 seconds, got {timeout_s!r}")
    if nnodes == 1:
        if dist_init_addr is not None:
            parse_dist_init_addr(dist_init_addr)
        return
    if dist_init_addr is None:
        raise ValueError(
            f"nnodes {nnodes} needs dist_init_addr HOST:PORT (node 0's address, the same on every node)"
        )
    parse_dist_init_addr(dist_init_addr)
    if world_size % nnodes:
        raise ValueError(
            f"nnodes {nnodes} does not divide the {world_size} processes "
            "(tensor_parallel_size x pipeline_parallel_size): every node runs as many"
        )


def node_process_range(world_size: int, nnodes: int, node_rank: int) -> range:
    """The processes node `node_rank` runs."""
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)
