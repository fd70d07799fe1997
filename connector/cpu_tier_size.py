"""The CPU tier's size when none is given: ``cpu_gb: auto`` (docs/serving.md, "CPU tier size").

``--kv-offload`` without ``--kv-offload-cpu-gb`` (or with ``auto``) sizes the tier from
the host's memory instead of a constant: a fixed 4 GiB held nothing of a workload of
8 documents x 20k tokens on an 8B model (issue 33), while a 60 GB tier cut its TTFT 2.6x.

The rule, per engine::

    reserve = min(10 GiB, MemTotal / 4)
    share   = AUTO_FRACTION x (MemTotal - reserve) / replicas_per_host
    cpu     = min(share, MemAvailable - reserve - engine_host_bytes), whole GiB, >= 1 GiB

* Half of the host, not all of it: the rest is the page cache that the weights are read
  through, other processes, and the engine's own host memory (SGLang's HiCache keeps
  10 GB of host memory back in the same way; LMCache's default is a fixed 5 GB). A small
  host (a laptop, a CI runner) keeps a quarter back instead of 10 GiB.
* ``MemTotal`` makes the share the same whatever else runs when the engine starts:
  replicas that start together each take their share instead of each seeing the same
  free memory and together taking it twice. ``replicas_per_host`` (``--kv-offload-
  replicas-per-host``) divides the share between the engines of one host.
* ``MemAvailable`` caps it, so that an engine on a host that is already full starts with
  what is there rather than pushing the host into swap or the OOM killer.
* ``engine_host_bytes``: what the engine itself holds in host memory beside the tier
  (its save buffers, weights kept in CPU memory with ``cpu_offload_gb``).

The host's memory is read with psutil by :func:`read_host_memory`; callers and tests pass
a :class:`HostMemory` of their own to :func:`auto_cpu_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
#: the share of (MemTotal - reserve) that one host's CPU tiers take together
AUTO_FRACTION = 0.5
#: host memory never given to an automatic CPU tier (as SGLang's HiCache reserves 10 GB),
#: or a quarter of a smaller host's
RESERVED_HOST_BYTES = 10 * GIB
#: an automatic tier smaller than this is refused: it would hold too little to matter
MIN_AUTO_BYTES = 1 * GIB
#: how ``cpu_gb`` asks for the automatic size
AUTO = "auto"


@dataclass(frozen=True)
class HostMemory:
    """The host's memory in bytes: ``total_bytes`` (MemTotal) and ``available_bytes``
    (MemAvailable: free memory plus what the kernel can reclaim)."""

    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class AutoCpuSize:
    """The chosen size and the sentence that explains it (logged at start-up)."""

    cpu_bytes: int
    reason: str


def read_host_memory() -> HostMemory:
    """This host's memory now (psutil; MemTotal and MemAvailable on Linux)."""
    import psutil

    memory = psutil.virtual_memory()
    return HostMemory(total_bytes=int(memory.total), available_bytes=int(memory.available))


def check_replicas_per_host(value: object) -> int:
    """``value`` as a count of engines sharing the host (an integer >= 1), else ValueError."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError("replicas_per_host must be an integer >= 1") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"replicas_per_host must be an integer >= 1, got {value!r}")
    return value


def auto_cpu_bytes(
    memory: HostMemory, *, replicas_per_host: int = 1, engine_host_bytes: int = 0
) -> AutoCpuSize:
    """The automatic CPU-tier size for one engine on a host with ``memory`` (rule in the
    module docstring), rounded down to whole GiB. Called once per engine start, before
    anything loads. ValueError when it comes out under ``MIN_AUTO_BYTES``, saying what
    was measured and which flag to set instead."""
    replicas_per_host = check_replicas_per_host(replicas_per_host)
    for name, value in (
        ("total_bytes", memory.total_bytes),
        ("available_bytes", memory.available_bytes),
        ("engine_host_bytes", engine_host_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"host memory {name} must be an integer >= 0, got {value!r}")
    reserve = min(RESERVED_HOST_BYTES, memory.total_bytes // 4)
    share = int(AUTO_FRACTION * (memory.total_bytes - reserve)) // replicas_per_host
    room = memory.available_bytes - reserve - engine_host_bytes
    cpu_bytes = max(0, min(share, room)) // GIB * GIB
    total_gib, available_gib = memory.total_bytes / GIB, memory.available_bytes / GIB
    if cpu_bytes < MIN_AUTO_BYTES:
        raise ValueError(
            f"cpu_gb auto: this host has {total_gib:.1f} GiB of memory, {available_gib:.1f} GiB available; "
            f"after a {reserve / GIB:.1f} GiB reserve and {engine_host_bytes / GIB:.1f} GiB for the "
            f"engine, {replicas_per_host} replica(s) per host leave less than {MIN_AUTO_BYTES // GIB} GiB for "
            "the CPU tier: give its size (--kv-offload-cpu-gb N, KVSTASH_KV_OFFLOAD_CPU_GB; 0 = no CPU tier)"
        )
    limit = "the host's share" if share <= room else "the memory available now"
    reason = (
        f"cpu_gb auto: {cpu_bytes // GIB} GiB, set by {limit} "
        f"({AUTO_FRACTION:g} x ({total_gib:.1f} GiB total - {reserve / GIB:.1f} GiB reserve) / "
        f"{replicas_per_host} replica(s) per host = {share / GIB:.1f} GiB; available {available_gib:.1f} GiB "
        f"- reserve - {engine_host_bytes / GIB:.1f} GiB for the engine = {room / GIB:.1f} GiB)"
    )
    return AutoCpuSize(cpu_bytes=cpu_bytes, reason=reason)
