"""The soak's samples: every few seconds, on a thread, what the serve process tree holds
(RSS, threads by name, open files by kind, shared-memory mappings, GPU memory; its
connections to the cache server and their staging areas apart from its other files), the disk
tier's bytes, the cache server's RSS and the server's ``/metrics`` counters.

``benchmarks/soak.py`` starts one `Sampler` when the load starts and stops it (one last
sample) when the load ended. It reads ``/proc``, ``psutil``, ``nvidia-smi`` and the
server's ``/metrics``; it changes nothing. A sample that fails is recorded in
``failures`` and the soak goes on.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from storage_backends.staging_area import AREA_NAME

if TYPE_CHECKING:
    from benchmarks.support.soak_children import Child
    from benchmarks.support.soak_load import Load

MIB = 1 << 20
#: /metrics samples kept per sample (name, label to keep or None)
METRICS = (
    ("kvstash_requests_total", "finish_reason"),
    ("kvstash_prompt_tokens_total", None),
    ("kvstash_generation_tokens_total", None),
    ("kvstash_gpu_prefix_hit_tokens_total", None),
    ("kvstash_external_hit_tokens_total", None),
    ("kvstash_kv_loaded_tokens_total", None),
    ("kvstash_kv_saved_tokens_total", None),
    ("kvstash_tier_hit_chunks_total", "tier"),
    ("kvstash_tier_errors_total", "tier"),
    ("kvstash_tier_breaker_trips_total", "tier"),
    ("kvstash_engine_step_errors_total", None),
    ("kvstash_engine_retried_requests_total", None),
    ("kvstash_kv_blocks_used", None),
)


class Soaked(Protocol):
    """What a sample reads of the soak (``benchmarks/soak.py``'s ``Soak``)."""

    #: ``time.monotonic()`` when the load started: samples are timed from there
    t0: float
    serve: Child
    cache_server: Child | None
    disk_dir: Path
    load: Load

    @property
    def url(self) -> str: ...


def process_tree(pid: int):
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_figures(pid: int) -> dict:
    """RSS, threads and open files of the process and its children (a pipeline stage, a
    tokenizer helper)."""
    import psutil

    rss = threads = fds = 0
    pids = []
    for proc in process_tree(pid):
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                threads += proc.num_threads()
                fds += proc.num_fds()
                pids.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return {"rss_bytes": rss, "threads": threads, "fds": fds, "pids": pids}


def thread_names(pids: list[int]) -> dict[str, int]:
    """How many threads of each OS name (Linux /proc; empty elsewhere): says which grew."""
    names: dict[str, int] = {}
    for pid in pids:
        for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
            try:
                name = comm.read_text().strip()
            except OSError:
                continue
            names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def fd_targets(pids: list[int]) -> list[str]:
    """What each open file of the processes is (``/proc/PID/fd`` links; empty elsewhere)."""
    targets = []
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                targets.append(os.readlink(fd))
            except OSError:
                continue  # closed meanwhile
    return targets


def fd_kinds(targets: list[str]) -> dict[str, int]:
    """Open files (``fd_targets``) by kind (socket, pipe, anon_inode:..., file)."""
    kinds: dict[str, int] = {}
    for target in targets:
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        if target.startswith("anon_inode:"):
            kind = target.split("[")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def shm_mappings(pids: list[int]) -> dict[str, int]:
    """Shared-memory mappings (/dev/shm, memfd) of the processes: how many and their bytes
    (the cache server's staging areas live there; Linux /proc; zeros elsewhere)."""
    count = size = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if "/dev/shm/" in line or "memfd:" in line:
                begin, end = (int(x, 16) for x in line.split()[0].split("-"))
                count += 1
                size += end - begin
    return {"count": count, "bytes": size}


def connections_of(pids: list[int], kind: str) -> list[list]:
    """Each process's sockets of ``kind`` (psutil's; a process gone meanwhile has none)."""
    import psutil

    per_process = []
    for pid in pids:
        try:
            per_process.append(psutil.Process(pid).net_connections(kind=kind))
        except psutil.Error:
            continue
    return per_process


def client_connections(pids: list[int], port: int) -> int:
    """Established TCP connections of clients to the server's HTTP ``port`` (the load's
    own connections: they come and go with the requests and the aborts)."""
    import psutil

    return sum(
        1
        for connections in connections_of(pids, "tcp")
        for c in connections
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def staging_areas(targets: list[str]) -> int:
    """Open shared-memory staging areas among open files (``fd_targets``): one per bulk
    connection to the cache server that uses one (``storage_backends/staging_area.py``)."""
    return sum(target.startswith(f"/memfd:{AREA_NAME}") for target in targets)


def accepted_connections(pids: list[int]) -> int:
    """Connections the processes accepted (the cache server's from its clients: during the
    soak only serve's gRPC channel and bulk connections): TCP ones to a port they listen
    on, and Unix-socket ones under a path they listen on (psutil names the listening
    socket's path on the accepted ones too; one per path is the listener)."""
    import psutil

    count = 0
    for connections in connections_of(pids, "all"):
        listen_ports = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        count += sum(
            1
            for c in connections
            if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port in listen_ports
        )
        unix_paths = [c.laddr for c in connections if c.family == socket.AF_UNIX and c.laddr]
        count += len(unix_paths) - len(set(unix_paths))
    return count


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory used by ``pids`` (nvidia-smi's per-process figures), None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    total = 0
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids and parts[1].isdigit():
            total += int(parts[1]) * MIB
    return total


def folder_bytes(path: Path) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk as du counts them) of a folder tree."""
    size = allocated = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue  # evicted meanwhile
            size += st.st_size
            allocated += st.st_blocks * 512
    return size, allocated


def read_metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = dict(METRICS)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                label = wanted[sample.name]
                key = (
                    sample.name
                    if label is None
                    else f"{sample.name}{{{label}={sample.labels.get(label, '')}}}"
                )
                values[key] = sample.value
    return values


class Sampler:
    """Every ``interval_s`` on a thread: one sample of the serve process tree, the GPU,
    the disk tier, the cache server and /metrics."""

    def __init__(self, soak: Soaked, interval_s: float) -> None:
        self.soak, self.interval_s = soak, interval_s
        self.samples: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        soak = self.soak
        t = time.monotonic() - soak.t0
        try:
            serve = tree_figures(soak.serve.process.pid)
            size, allocated = folder_bytes(soak.disk_dir)
            cache = soak.cache_server
            cache_rss = None
            cache_connections = 0
            if cache is not None and cache.process is not None and cache.process.poll() is None:
                cache_figures = tree_figures(cache.process.pid)
                cache_rss = cache_figures["rss_bytes"]
                cache_connections = accepted_connections(cache_figures["pids"])
            connections = client_connections(serve["pids"], soak.serve.port)
            targets = fd_targets(serve["pids"])
            # serve's pool towards the cache server: per bulk connection a socket and its
            # shared-memory staging area, grown on demand up to the pool's bound
            cache_fds = cache_connections + staging_areas(targets)
            sample = {
                "t_s": round(t, 2),
                "serve_rss_bytes": serve["rss_bytes"],
                "serve_threads": serve["threads"],
                # open files other than the load's own connections to the HTTP port and
                # serve's pool towards the cache server (tracked apart: cache_server_fds)
                "serve_fds": serve["fds"] - connections - cache_fds,
                "serve_fds_all": serve["fds"],
                "client_connections": connections,
                "cache_server_fds": cache_fds if cache_rss is not None else None,
                "thread_names": thread_names(serve["pids"]),
                "fd_kinds": fd_kinds(targets),
                "shm_mappings": shm_mappings(serve["pids"]),
                "gpu_bytes": gpu_bytes(serve["pids"]),
                # what the tier's cap counts (its files' sizes), and what du shows
                "disk_bytes": size,
                "disk_du_bytes": allocated,
                "cache_server_rss_bytes": cache_rss,
                "requests_done": soak.load.num_done,
                "metrics": read_metrics(soak.url),
            }
        except Exception as error:  # noqa: BLE001 - a failed sample is reported, the soak goes on
            self.failures.append(f"t={t:.1f}s {type(error).__name__}: {error}")
            return
        self.samples.append(sample)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the last one, after the load stopped
