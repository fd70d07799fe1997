"""The first failure that broke the engine's process group, kept in its rendezvous store.

A process whose step raised after its ranks entered the step's collectives (inside a
tensor-parallel forward pass) cannot keep its peers in step: they wait in a collective
for it. It records its error here (the store is node 0's TCPStore: every process of
every node reaches it, and its server thread answers while the engine's own thread
waits in a collective), answers the step and exits; its exit breaks the peers'
collectives within moments (gloo sees the connection close: `CollectiveError`, which
is never recorded), each of them exits in turn, and the executor reports the recorded
error, not the broken collectives that followed it (docs/architecture.md, Tensor
parallelism). A process killed outright records nothing: the executor names it from
its exit.
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

_KEY = "kvstash/first-failure"


def process_name(process_index: int, tp_size: int, num_stages: int) -> str:
    """Process p in messages: its stage, and its rank with tensor parallelism."""
    if tp_size == 1:
        return f"pipeline stage {process_index}"
    if num_stages == 1:
        return f"tensor-parallel rank {process_index}"
    return f"pipeline stage {process_index // tp_size} rank {process_index % tp_size}"


class CollectiveError(RuntimeError):
    """A collective or a send/receive of the engine's process groups failed: a peer is
    gone (gloo saw its connection close) or timed out. A consequence, never recorded as
    the first failure: the process that failed first recorded its own error, or died."""


def start_collective(op, *args):
    """``op(*args)``: a send, receive or collective of a process group -> its work. A
    failure to start it is raised as CollectiveError too (gloo raises at once, not from
    ``wait``, when a peer's connection is already closed: a killed node's ranks)."""
    try:
        return op(*args)
    except RuntimeError as error:
        raise CollectiveError(f"a collective of the process group failed: {error}") from error


def wait_collective(work) -> None:
    """`work.wait()`, a failure raised as CollectiveError (called by every collective and
    send/receive of engine.pipeline.comm and engine.tensor_parallel.comm)."""
    try:
        work.wait()
    except RuntimeError as error:
        raise CollectiveError(f"a collective of the process group failed: {error}") from error


def run_collective(op, *args) -> None:
    """``op(*args)`` started and waited for (:func:`start_collective`, :func:`wait_collective`):
    a blocking send, receive or collective."""
    wait_collective(start_collective(op, *args))


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, is a CollectiveError."""
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, CollectiveError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def breaks_group(error: BaseException) -> bool:
    """Whether `error` left the process group out of step (see `mark_breaks_group`)."""
    return bool(getattr(error, "breaks_group", False))


def mark_breaks_group(error: BaseException) -> None:
    """Called by a rank's runner when its step raised after the step's first collective."""
    with contextlib.suppress(AttributeError):
        error.breaks_group = True


def record_failure(store: dist.Store, text: str) -> None:
    """Keep `text` unless a failure was recorded first; never raises (the store may be
    gone with node 0)."""
    with contextlib.suppress(Exception):
        store.compare_set(_KEY, "", text)


def first_failure(store: dist.Store) -> str | None:
    """The recorded failure, or None (also when the store cannot be read)."""
    with contextlib.suppress(Exception):
        if store.check([_KEY]):
            return store.get(_KEY).decode()
    return None


def end_processes(processes, grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for ``processes`` (each told to stop) to exit, then
    terminate, then kill, those still running: the engine's rank processes at its shutdown,
    another node's at node 0's word."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join(1.0)
