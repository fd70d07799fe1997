"""A node after the first (`--nnodes N --node-rank R`, R ≥ 1): its launch runs its share
of the engine's processes and nothing else (no scheduler, no HTTP server).

`run_node` (called by `LLM(...)`, `kvstash serve` and `kvstash generate` when
node_rank > 0) connects to node 0's control channel (engine.pipeline.control; it
waits up to `dist_init_timeout` for node 0 to listen), starts one process per rank of
this node (`run_remote_process`: it connects too, takes its spec from node 0, fills in
this host's model folder, device and address, and runs as a stage process,
engine.pipeline.worker), then watches both: node 0's word or its connection's end,
and its processes' exits. It returns when node 0's engine shut down cleanly; it
raises `NodeError` (engine.pipeline.control) when node 0 stopped on an error or went away, or one of its own
processes died (node 0 is told which first). Its processes never outlive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import sys
from pathlib import Path
from typing import Any

from engine.nodes import node_process_range, parse_dist_init_addr
from engine.pipeline.control import MAGIC, Hello, NodeError, NodeStartError, connect
from engine.pipeline.failure import end_processes, process_name
from engine.pipeline.layer_split import stage_device
from engine.pipeline.worker import run_stage

logger = logging.getLogger(__name__)

#: after node 0's stop, this node's processes get this long to exit before being killed
STOP_GRACE_S = 5.0


def run_node(model_dir: Path | None, args: Any) -> None:
    """Run node `args.node_rank`'s processes until node 0's engine ends (see the module
    docstring). `args` is a validated `EngineArgs` with node_rank ≥ 1. Raises
    NodeStartError when node 0 never came, NodeError as said."""
    address = parse_dist_init_addr(args.dist_init_addr)
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    indices = node_process_range(world_size, args.nnodes, args.node_rank)
    hello = Hello(MAGIC, args.node_rank, None, world_size, args.nnodes, args.tensor_parallel_size)
    conn, _ = connect(address.host, address.control_port, hello, args.dist_init_timeout)
    logger.info(
        "node %d: connected to node 0 at %s; starting processes %s",
        args.node_rank,
        address.host,
        list(indices),
    )
    device = args.resolve_device()
    context = multiprocessing.get_context("spawn")
    p_to_process: dict[int, Any] = {}
    try:
        for p in indices:
            local_device = stage_device(device, p - indices.start, len(indices))
            process = context.Process(
                target=run_remote_process,
                args=(
                    address.host,
                    address.control_port,
                    Hello(MAGIC, args.node_rank, p, world_size, args.nnodes, args.tensor_parallel_size),
                    args.dist_init_timeout,
                    None if model_dir is None else str(model_dir),
                    str(local_device),
                ),
                name=f"kvstash-node{args.node_rank}-process{p}",
                daemon=True,
            )
            process.start()
            p_to_process[p] = process
        _watch(conn, p_to_process, args)
    finally:
        _stop(p_to_process)
        conn.close()


def run_remote_process(
    host: str, control_port: int, hello: Hello, timeout_s: float, model_dir: str | None, device: str
) -> None:
    """Entry point of one of this node's processes (spawned by `run_node`)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s node{hello.node_rank}-p{hello.process_index} %(message)s"
    )
    try:
        conn, local_host = connect(host, control_port, hello, timeout_s)
        spec = conn.recv()
    except (NodeStartError, EOFError, OSError) as error:
        print(f"kvstash node {hello.node_rank} process {hello.process_index}: {error}", file=sys.stderr)
        sys.exit(1)
    spec = dataclasses.replace(
        spec,
        model_dir=model_dir if model_dir is not None else spec.model_dir,
        device=device,
        local_host=local_host,
    )
    run_stage(spec, conn)


def _watch(conn: multiprocessing.connection.Connection, p_to_process: dict[int, Any], args: Any) -> None:
    sentinel_to_p = {process.sentinel: p for p, process in p_to_process.items()}
    while True:
        ready = multiprocessing.connection.wait([conn, *sentinel_to_p])
        if conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                raise NodeError(
                    f"node {args.node_rank}: node 0 went away (its engine or its host is gone)"
                ) from None
            if isinstance(message, tuple) and message[0] == "stop":
                if message[1] is None:
                    logger.info("node %d: node 0's engine shut down; stopping", args.node_rank)
                    return
                raise NodeError(f"node {args.node_rank}: node 0's engine stopped: {message[1]}")
            raise NodeError(f"node {args.node_rank}: node 0 sent {message!r:.200}")
        for sentinel in ready:
            p = sentinel_to_p[sentinel]
            process = p_to_process[p]
            process.join(1.0)
            code = process.exitcode
            how = (
                f"was killed by signal {-code}"
                if code is not None and code < 0
                else f"exited with code {code}"
            )
            name = process_name(p, args.tensor_parallel_size, args.pipeline_parallel_size)
            text = f"{name} (pid {process.pid}) {how}"
            with contextlib.suppress(OSError):  # node 0 is gone too: its own check tells it
                conn.send(("dead", text))
            raise NodeError(f"node {args.node_rank}: {text}")


def _stop(p_to_process: dict[int, Any]) -> None:
    """Wait for the processes (node 0 sent each its stop), then terminate and kill."""
    end_processes(list(p_to_process.values()), STOP_GRACE_S)
