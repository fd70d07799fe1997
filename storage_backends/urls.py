"""Parsing of backend URLs such as ``cpu://?capacity=4GiB`` or ``redis://host:6379/0?ttl=3600``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"1048576"``, ``"512MiB"``, ``"4GB"`` or an int. Raises ValueError naming ``what``."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(text)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{what}: cannot read {text!r} as a byte size (e.g. 1048576, 512MiB, 4GB)")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def parse_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def parse_bool(text: str, what: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what}: {text!r} is not a boolean (use 1/0, true/false)")


def _query_params(parts: SplitResult, allowed_params: Iterable[str]) -> dict[str, str]:
    """``parts``' query parameters; an unknown or repeated one is a ValueError stating the reason
    (not the URL: callers name where the URL came from)."""
    allowed = set(allowed_params)
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in allowed:
            raise ValueError(f"unknown parameter {name!r} (allowed: {', '.join(sorted(allowed))})")
        if name in params:
            raise ValueError(f"parameter {name!r} given twice")
        params[name] = value
    return params


def split_backend_url(url: str, allowed_params: Iterable[str]) -> tuple[SplitResult, dict[str, str]]:
    """Split ``url`` and return its parts and query parameters; unknown or repeated parameters are a ValueError."""
    parts = urlsplit(url)
    try:
        params = _query_params(parts, allowed_params)
    except ValueError as error:
        raise ValueError(f"{error} in {parts.scheme}:// URL {url!r}") from None
    return parts, params


# ---- remote tiers: parsed in full before anything connects --------------------------------

#: the remote tiers' URL schemes (``storage_backends.registry`` maps each to its backend)
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
GRPC_SCHEMES = ("grpc", "grpcs")
REMOTE_SCHEMES = REDIS_SCHEMES + GRPC_SCHEMES
#: the codecs of stored values (``storage_backends.chunk.CODECS``, kept here without torch)
VALUE_CODECS = ("none", "lz4")
GRPC_PARAMS = ("token", "ca", "timeout", "codec", "concurrency", "bulk", "bulk_connections", "local")
#: kvstash's own parameters of a Redis URL (the others are redis-py's)
REDIS_OWN_PARAMS = ("ttl", "timeout", "codec", "key_prefix")


def _host_and_port(parts: SplitResult, example: str) -> tuple[str, int | None]:
    """The URL's host name and port (None when absent); ValueError for a port that is no number."""
    try:
        port = parts.port
    except ValueError:
        raw = parts.netloc.rpartition(":")[2]
        raise ValueError(f"port {raw!r} is not a number from 1 to 65535 (expected {example})") from None
    if port == 0:
        raise ValueError(f"port 0 is not a port to connect to (expected {example})")
    return parts.hostname or "", port


def _positive_int(text: str, what: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return int(text)


def parse_grpc_url(url: str) -> dict[str, Any]:
    """``GrpcBackend``'s keyword arguments for ``grpc://HOST:PORT[?params]`` (or ``grpcs://``),
    checked in full without connecting (the CA file must exist). A ValueError states the reason,
    e.g. ``no port (expected grpc://HOST:PORT)``, not the URL."""
    parts = urlsplit(url)
    if parts.scheme not in GRPC_SCHEMES:
        raise ValueError("not a grpc:// or grpcs:// URL")
    example = f"{parts.scheme}://HOST:PORT"
    params = _query_params(parts, GRPC_PARAMS)
    host, port = _host_and_port(parts, example)
    if not host:
        raise ValueError(f"no host (expected {example})")
    if port is None:
        raise ValueError(f"no port (expected {example})")
    if parts.path not in ("", "/"):
        raise ValueError(f"a grpc URL takes no path, got {parts.path!r} (expected {example})")
    bulk = params.get("bulk", "on")
    if bulk not in ("on", "off"):
        raise ValueError(f"bulk must be 'on' or 'off', got {bulk!r}")
    local = params.get("local", "auto")
    if local not in ("auto", "off"):
        raise ValueError(f"local must be 'auto' or 'off', got {local!r}")
    codec = params.get("codec", "none")
    if codec not in VALUE_CODECS:
        raise ValueError(f"unknown codec {codec!r} (expected one of {', '.join(VALUE_CODECS)})")
    ca_path = params.get("ca")
    if ca_path is not None:
        if parts.scheme != "grpcs":
            raise ValueError("a TLS CA (ca=) only makes sense with TLS (grpcs://)")
        if not Path(ca_path).is_file():
            raise ValueError(f"CA file {ca_path!r} does not exist")
    kwargs: dict[str, Any] = {
        "address": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        "secure": parts.scheme == "grpcs",
        "token": params.get("token"),
        "ca_path": ca_path,
        "codec": codec,
        "bulk": bulk == "on",
        "local": local == "auto",
    }
    if "timeout" in params:
        kwargs["timeout_s"] = parse_float(params["timeout"], "timeout")
    for name in ("concurrency", "bulk_connections"):
        if name in params:
            kwargs[name] = _positive_int(params[name], name)
    return kwargs


def parse_redis_url(url: str) -> tuple[str, dict[str, Any]]:
    """The redis-py URL (kvstash's own parameters taken out) and ``RedisBackend``'s keyword
    arguments for a ``redis://``, ``rediss://`` or ``+cluster`` URL, checked without connecting.
    A ValueError states the reason, not the URL."""
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"not a Redis URL (expected one of {', '.join(s + '://' for s in REDIS_SCHEMES)})")
    _host_and_port(parts, f"{parts.scheme}://HOST:PORT")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise ValueError(f"the path {parts.path!r} must be a database number such as /0")
    own: dict[str, str] = {}
    passed_on: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in REDIS_OWN_PARAMS:
            if name in own:
                raise ValueError(f"parameter {name!r} given twice")
            own[name] = value
        else:
            passed_on.append((name, value))
    codec = own.get("codec", "none")
    if codec not in VALUE_CODECS:
        raise ValueError(f"unknown codec {codec!r} (expected one of {', '.join(VALUE_CODECS)})")
    kwargs: dict[str, Any] = {"codec": codec}
    if "ttl" in own:
        kwargs["ttl_s"] = int(parse_float(own["ttl"], "ttl"))
        if kwargs["ttl_s"] <= 0:
            raise ValueError(f"ttl must be at least 1 second, got {own['ttl']!r}")
    if "timeout" in own:
        kwargs["timeout_s"] = parse_float(own["timeout"], "timeout")
    if "key_prefix" in own:
        kwargs["key_prefix"] = own["key_prefix"]
    return urlunsplit(parts._replace(query=urlencode(passed_on))), kwargs


def check_remote_url(url: str) -> None:
    """Check a remote tier's URL (``REMOTE_SCHEMES``) as its backend will read it, without
    connecting: a ValueError states the reason (``no port (expected grpc://HOST:PORT)``), never
    the URL, so the caller can name what the user typed and where (a flag, a file, a variable)."""
    if not isinstance(url, str):
        raise ValueError(f"must be a URL string, got {type(url).__name__}")
    scheme = urlsplit(url).scheme
    if scheme not in REMOTE_SCHEMES:
        raise ValueError("must start with one of " + ", ".join(f"{s}://" for s in REMOTE_SCHEMES))
    if scheme in GRPC_SCHEMES:
        parse_grpc_url(url)
    else:
        parse_redis_url(url)
