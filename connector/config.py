"""``OffloadConfig``: what the connector stores where (docs/architecture.md, Connector).

Built by the engine's caller (``engine.LLM(kv_offload=...)``), by the CLI flags
in ``engine/offload_cli.py``, from a YAML file or from ``KVSTASH_KV_OFFLOAD_*``
environment variables. Validation happens once, at construction, and raises
``ValueError`` naming the bad field.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

# REMOTE_SCHEMES: the schemes accepted for ``remote_url`` (re-exported)
from connector.cpu_tier_size import (
    AUTO,
    HostMemory,
    auto_cpu_bytes,
    check_replicas_per_host,
    read_host_memory,
)
from storage_backends.urls import REMOTE_SCHEMES, check_remote_url  # noqa: F401

logger = logging.getLogger(__name__)

GIB = 1 << 30

CODECS = ("none", "lz4")
LOAD_POLICIES = ("planned", "always")
#: roles of disaggregated prefill/decode (vLLM's kv_producer / kv_consumer / kv_both)
KV_ROLES = ("both", "producer", "consumer")
#: how a producer hands a prompt's KV to a consumer (connector.handoff): "shared" through the
#: shared (remote) tier, "direct" from its CPU tier through NIXL (connector.direct_transfer),
#: "auto" direct where NIXL imports, else shared
KV_TRANSFERS = ("auto", "direct", "shared")
#: lower tiers reached over the network, shared by every engine pointed at them: measured
#: in the background (connector.tier_probe), read ``remote_reads_in_flight`` at a time,
#: and the tier a disaggregated hand-over goes through (connector.handoff)
REMOTE_TIER_NAMES = frozenset({"redis", "grpc"})


def reads_in_flight_for(tier_name: str, *, local: int, remote: int, limit: int | None = None) -> int:
    """Background reads in flight for a lower tier: ``remote`` for Redis and the cache
    server (their link wants more), ``local`` for the disk; at most ``limit``, the reads the
    tier itself runs at once (``StorageBackend.max_reads_in_flight``): more threads would
    wait for its connections, and the planner would plan with a count that never runs."""
    count = remote if tier_name in REMOTE_TIER_NAMES else local
    return count if limit is None else max(1, min(count, limit))


#: environment variable prefix; each field ``x`` is read from ``KVSTASH_KV_OFFLOAD_X``
ENV_PREFIX = "KVSTASH_KV_OFFLOAD_"
#: longest ``key_prefix``, in characters (the cache server's keys are at most 1 KiB)
MAX_KEY_PREFIX_CHARS = 128


@dataclass(frozen=True)
class OffloadConfig:
    """Connector settings. Sizes are bytes; 0 CPU bytes means no CPU tier."""

    #: tokens per chunk; chunk keys and the unit of store/retrieve
    chunk_size: int = 256
    #: byte cap of the CPU-memory tier (pinned when CUDA is used); 0 disables it
    cpu_bytes: int = 4 * GIB
    #: folder of the local-disk tier; None disables it
    disk_path: str | None = None
    #: byte cap of the local-disk tier
    disk_bytes: int = 16 * GIB
    #: remote tier: redis://, rediss://, redis+cluster://, rediss+cluster:// (TLS), grpc:// or grpcs://
    #: URL; None disables it
    remote_url: str | None = None
    #: serialization codec for disk and remote tiers
    codec: str = "none"
    #: store the trailing partial chunk of a prompt under its own key
    save_partial_chunks: bool = True
    #: load layer by layer so loading layer l+1 overlaps computing layer l (CUDA)
    layerwise: bool = False
    #: chunks waiting to be written to lower tiers; beyond it lower-tier writes are dropped (counted)
    save_queue_size: int = 256
    #: bytes of host buffers for chunks stored without a CPU-tier slot (it has no room, or
    #: there is none) while they wait for the lower tiers; beyond it such writes are dropped
    #: (counted). On CUDA they are pinned, and torch keeps pinned memory once used.
    save_buffer_bytes: int = 1 << 30
    #: seconds after which a pin taken by ``lookup(pin=True)`` is released if no retrieve came
    pin_timeout_s: float = 30.0
    #: text put in front of every chunk key the engine reads or writes, in every tier: the
    #: tenant's prefix on a cache server started with ``--tenants`` (e.g. ``"tenant-a/"``)
    key_prefix: str = ""
    #: hits below the CPU tier are fetched into it in the background while the request
    #: waits (without a CPU tier: into the staging area, ``staging_bytes``); off: they are
    #: read in the admitting step (blocks it)
    async_loads: bool = True
    #: without a CPU tier (``cpu_bytes`` 0) and with a lower tier: host memory that fetched
    #: chunks land in until their load (pinned with CUDA; stores never use it, a fetch is
    #: planned to fit it); 0: lower-tier hits are read inside the admitting step (blocks it)
    staging_bytes: int = 256 << 20
    #: a waiting request loads its fetch's chunks as they arrive (the host->device copy of
    #: chunk i overlaps fetching chunk i+1), computing nothing until the rest is in; off:
    #: it waits until the whole fetch is in the CPU tier, then loads it in one step
    pipelined_loads: bool = True
    #: background reads in flight per local lower tier (the disk). More reads share the
    #: device, so the first chunks of a fetch arrive later (with 8, a pipelined 16k disk hit
    #: on an H200 took 470 ms where 4 took 375)
    reads_in_flight: int = 4
    #: background reads in flight per remote tier (Redis, the cache server): more fill the
    #: link (with 8, a 16k gRPC hit on an H200 took 201 ms where 4 took 222). A cache
    #: server's tier opens as many bulk connections unless its URL names ``bulk_connections``
    #: (``backend_urls``); a tier that runs fewer reads at once gets that many
    remote_reads_in_flight: int = 8
    #: longest a step waits for a lower tier's lookup answer per request (then asks next step)
    lookup_wait_s: float = 0.002
    #: a lookup unanswered this long ends with what it found; its tier is skipped for a back-off
    lookup_timeout_s: float = 0.5
    #: first back-off of a failing tier's circuit breaker (doubles per failed probe, up to 60 s)
    breaker_backoff_s: float = 1.0
    #: a fetch waits at most this fraction of the time recomputing its tokens would take
    fetch_deadline_fraction: float = 0.5
    #: each remote tier is measured when opened (one chunk-sized value written, read once,
    #: then ``reads_in_flight`` times at once); a tier the plans skip is measured again at
    #: most this often; 0: never measure in the background (priors until fetches measure)
    tier_probe_interval_s: float = 5.0
    #: "planned": load a lower-tier hit only where it beats recomputing (measured rates);
    #: "always": load every hit, waiting for the fetch however long it takes
    load_policy: str = "planned"
    #: on CPU, run KV moves on a worker thread so stores publish and loads complete
    #: asynchronously as on CUDA (tests and CI exercise those paths; slower, not for production)
    cpu_async_moves: bool = False
    #: on CUDA, loads from pinned CPU-tier slots are unpacked by a kernel that reads the host
    #: memory directly (one launch per layer for all of a step's chunks, no staging buffer,
    #: the forward pass waits per layer). Off by default: its programs take SMs from the
    #: forward pass beside it, and on the H100 an 8k-token hit took 32.9 ms against 29.4-31.4
    #: ms through the staging buffers (host->device copies by the copy engine, 2 layer pieces)
    direct_host_loads: bool = False
    #: disaggregated prefill/decode: this engine's role (``KV_ROLES``; the engine sets it
    #: from ``EngineArgs.kv_role``); "both" hands nothing over and makes no NIXL agent
    kv_role: str = "both"
    #: how a producer hands its prompts' KV over, and how a consumer takes it (``KV_TRANSFERS``)
    kv_transfer: str = "auto"
    #: producer, shared path: the longest wait for a request's chunks to reach the shared tier
    handoff_durable_timeout_s: float = 30.0
    #: consumer: the longest wait for the fetch of what a producer handed over (then it recomputes)
    handoff_fetch_deadline_s: float = 30.0
    #: producer, direct path: how long a hand-over's chunks stay pinned for a consumer that
    #: does not say it is done (a consumer reads them within half of it, else recomputes)
    direct_hold_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {self.chunk_size!r}")
        for name in ("cpu_bytes", "disk_bytes", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer number of bytes, got {value!r}")
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ValueError(f"disk_path must be a non-empty path string or None, got {self.disk_path!r}")
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError("disk_bytes must be positive when disk_path is set")
        if self.remote_url is not None:
            # in full (host, port, parameters), so that a bad URL fails here, before a model loads
            try:
                check_remote_url(self.remote_url)
            except ValueError as error:
                raise ValueError(f"remote_url {self.remote_url!r}: {error}") from None
        if self.codec not in CODECS:
            raise ValueError(f"codec must be one of {', '.join(CODECS)}, got {self.codec!r}")
        for name in (
            "save_partial_chunks",
            "layerwise",
            "async_loads",
            "pipelined_loads",
            "cpu_async_moves",
            "direct_host_loads",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.save_queue_size, bool) or not isinstance(self.save_queue_size, int):
            raise ValueError(f"save_queue_size must be an integer, got {self.save_queue_size!r}")
        if self.save_queue_size <= 0:
            raise ValueError(f"save_queue_size must be positive, got {self.save_queue_size}")
        if isinstance(self.save_buffer_bytes, bool) or not isinstance(self.save_buffer_bytes, int):
            raise ValueError(f"save_buffer_bytes must be an integer, got {self.save_buffer_bytes!r}")
        if self.save_buffer_bytes < 0:
            raise ValueError(f"save_buffer_bytes must be >= 0, got {self.save_buffer_bytes}")
        if not isinstance(self.pin_timeout_s, (int, float)) or not self.pin_timeout_s > 0:
            raise ValueError(
                f"pin_timeout_s must be a positive number of seconds, got {self.pin_timeout_s!r}"
            )
        check_key_prefix(self.key_prefix)
        for name in ("reads_in_flight", "remote_reads_in_flight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
                raise ValueError(f"{name} must be an integer in [1, 256], got {value!r}")
        for name in ("lookup_wait_s", "lookup_timeout_s", "breaker_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        fraction = self.fetch_deadline_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fetch_deadline_fraction must be in (0, 1], got {fraction!r}")
        interval = self.tier_probe_interval_s
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not 0 <= interval < math.inf
        ):
            raise ValueError(
                f"tier_probe_interval_s must be a finite number of seconds >= 0 (0: never probe), got {interval!r}"
            )
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(
                f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(
                f"kv_transfer must be one of {', '.join(KV_TRANSFERS)}, got {self.kv_transfer!r}"
            )
        for name in ("handoff_durable_timeout_s", "handoff_fetch_deadline_s", "direct_hold_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        if self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ValueError("no tier configured: set cpu_bytes > 0, disk_path or remote_url")

    # ---- construction from text sources --------------------------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "config") -> OffloadConfig:
        """Build from field names (plus ``cpu_gb``/``disk_gb`` in GiB, ``cpu_gb: auto`` with
        ``replicas_per_host``); values may be strings (as in env vars) and are converted to
        each field's type."""
        return config_from_fields(parse_fields(values, source=source), source=source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> OffloadConfig:
        """Read a YAML mapping of field names (see :meth:`from_mapping`)."""
        return config_from_fields(
            parse_fields(read_yaml(path), source=f"offload config file {str(path)!r}"), source=str(path)
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OffloadConfig:
        """Read ``KVSTASH_KV_OFFLOAD_<FIELD>`` variables (e.g. ``KVSTASH_KV_OFFLOAD_CPU_GB=8``)."""
        values = env_values(os.environ if environ is None else environ)
        return config_from_fields(
            parse_fields(values, source="environment", spelled=env_name), source="environment"
        )


def check_key_prefix(key_prefix: object) -> None:
    """ValueError unless ``key_prefix`` is printable ASCII (no spaces) of at most
    ``MAX_KEY_PREFIX_CHARS`` characters; keys travel in URLs, logs and admin tables."""
    if not isinstance(key_prefix, str):
        raise ValueError(f"key_prefix must be a string, got {key_prefix!r}")
    if len(key_prefix) > MAX_KEY_PREFIX_CHARS:
        raise ValueError(f"key_prefix has {len(key_prefix)} characters, more than {MAX_KEY_PREFIX_CHARS}")
    bad = next((char for char in key_prefix if not "!" <= char <= "~"), None)
    if bad is not None:
        raise ValueError(f"key_prefix must be printable ASCII without spaces, got {bad!r} in {key_prefix!r}")


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(OffloadConfig)}


def config_from_fields(
    fields: Mapping[str, Any],
    *,
    source: str,
    host_memory: HostMemory | None = None,
    engine_host_bytes: int = 0,
) -> OffloadConfig:
    """``OffloadConfig(**fields)`` for settings read from text sources (merged by the caller).

    A disk size given without a disk folder would silently give no disk tier, so it is an
    error here (the dataclass itself cannot tell a given size from its default).
    ``cpu_bytes`` ``"auto"`` is sized from ``host_memory`` (default: this host's, read
    now) by :func:`connector.cpu_tier_size.auto_cpu_bytes`, divided by the fields'
    ``replicas_per_host`` and less ``engine_host_bytes`` and the save buffers; the choice
    and its reason are logged.
    """
    fields = dict(fields)
    replicas_per_host = fields.pop("replicas_per_host", 1)
    if fields.get("cpu_bytes") == AUTO:
        save_buffer_bytes = fields.get("save_buffer_bytes", OffloadConfig.save_buffer_bytes)
        auto = auto_cpu_bytes(
            host_memory if host_memory is not None else read_host_memory(),
            replicas_per_host=replicas_per_host,
            engine_host_bytes=engine_host_bytes + max(0, save_buffer_bytes),
        )
        logger.info("kv offload: CPU tier of %d GiB; %s", auto.cpu_bytes // GIB, auto.reason)
        fields["cpu_bytes"] = auto.cpu_bytes
    if "disk_bytes" in fields and fields.get("disk_path") is None:
        raise ValueError(
            f"{source}: a disk tier size (disk_gb / disk_bytes, --kv-offload-disk-gb) is set but no "
            "disk folder: set disk_path (--kv-offload-disk-path, KVSTASH_KV_OFFLOAD_DISK_PATH) too"
        )
    return OffloadConfig(**fields)


_GIB_ALIASES = {"cpu_gb": "cpu_bytes", "disk_gb": "disk_bytes"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (1/0, true/false, yes/no, on/off)",
}


def _convert(name: str, value: Any) -> Any:
    """``value`` (a string from an environment variable or YAML, or already typed) as field
    ``name``'s type; ValueError stating the reason."""
    kind = _FIELD_TYPES[name]
    if value is None or not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
    except ValueError:
        raise ValueError(f"{name} must be {_KIND_WORDS[kind]}") from None
    if kind == "str | None" and text.lower() in ("", "none"):
        return None
    return text


def _check_alone(name: str, value: Any) -> None:
    """Check one setting on its own, as it would be on an otherwise default config (the rules
    between settings, such as "some tier", are checked when the whole config is built)."""
    if name == "remote_url":
        if value is not None:
            check_remote_url(value)  # states the reason only; the caller quotes the value
        return
    others = {"disk_path": "."} if name == "cpu_bytes" else {}  # 0 CPU bytes alone is no tier
    OffloadConfig(**others, **{name: value})


def parse_fields(
    values: Mapping[str, Any], *, source: str, spelled: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """Normalize a mapping of user-facing names to ``OffloadConfig`` keyword arguments, each
    checked on its own, so that an error names where its value came from.

    ``cpu_gb``/``disk_gb`` (GiB, may be fractional) become ``cpu_bytes``/``disk_bytes``;
    ``cpu_gb: auto`` stays ``"auto"`` (sized by :func:`config_from_fields`), and
    ``replicas_per_host`` (an integer >= 1, read only by that sizing) passes through.
    Unknown names or bad values raise ``ValueError`` as ``"{source}: {spelled(name)} {value!r}:
    {reason}"``, quoting the value as given; ``spelled`` is how the user wrote a name (e.g.
    ``KVSTASH_KV_OFFLOAD_CHUNK_SIZE``; default: the name itself).
    """
    spell = spelled or (lambda name: name)
    unknown = sorted(set(values) - set(_FIELD_TYPES) - set(_GIB_ALIASES) - {"replicas_per_host"})
    if unknown:
        raise ValueError(f"{source}: unknown offload setting(s) {', '.join(spell(name) for name in unknown)}")
    fields: dict[str, Any] = {}
    for name, value in values.items():
        try:
            if name == "replicas_per_host":
                field, converted = name, check_replicas_per_host(value)
            elif name in ("cpu_gb", "cpu_bytes") and isinstance(value, str) and value.strip().lower() == AUTO:
                field, converted = "cpu_bytes", AUTO  # sized from the host by config_from_fields
            elif name in _GIB_ALIASES:
                try:
                    gib = float(value)
                except (TypeError, ValueError):
                    raise ValueError(f"{name} must be a number of GiB") from None
                if not 0 <= gib < math.inf:
                    raise ValueError(f"{name} must be a number of GiB >= 0")
                field, converted = _GIB_ALIASES[name], int(gib * GIB)
            else:
                field, converted = name, _convert(name, value)
            if converted != AUTO and field != "replicas_per_host":
                _check_alone(field, converted)
        except ValueError as error:
            raise ValueError(f"{source}: {spell(name)} {value!r}: {error}") from None
        fields[field] = converted
    return fields


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a YAML file holding one mapping (empty file = empty mapping)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"offload config file {str(file)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"offload config file {str(file)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"offload config file {str(file)!r} must hold a mapping of settings")
    return data


def env_name(name: str) -> str:
    """The environment variable of setting ``name``: ``KVSTASH_KV_OFFLOAD_<NAME>``."""
    return ENV_PREFIX + name.upper()


def env_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``KVSTASH_KV_OFFLOAD_*`` variables as a settings mapping (lower-case names).

    ``KVSTASH_KV_OFFLOAD`` (the on switch) and ``KVSTASH_KV_OFFLOAD_CONFIG`` (a YAML
    path) are not settings and are left out.
    """
    values = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX) and key != ENV_PREFIX + "CONFIG":
            values[key[len(ENV_PREFIX) :].lower()] = value
    return values


def backend_urls(config: OffloadConfig) -> list[str]:
    """The ``create_backend`` URLs of the configured lower tiers (disk, then remote); the
    remote URL gets ``config.codec`` and a cache server's ``bulk_connections`` =
    ``remote_reads_in_flight`` unless it names its own (a connection per read in flight: with
    the tier's default of 4, half of a fetch's 8 reads waited while the planner counted 8)."""
    urls = []
    if config.disk_path is not None:
        urls.append(
            f"file://{Path(config.disk_path).resolve()}?capacity={config.disk_bytes}&codec={config.codec}"
        )
    if config.remote_url is not None:
        parts = urlsplit(config.remote_url)
        query = parse_qs(parts.query)
        added = [] if "codec" in query else [f"codec={config.codec}"]
        if parts.scheme in ("grpc", "grpcs") and "bulk_connections" not in query:
            added.append(f"bulk_connections={config.remote_reads_in_flight}")
        separator = "&" if "?" in config.remote_url else "?"
        urls.append(f"{config.remote_url}{separator}{'&'.join(added)}" if added else config.remote_url)
    return urls
