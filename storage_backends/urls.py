"""Parsing of backend URLs such as ``cpu://?capacity=4GiB`` or ``redis://host:6379/0?ttl=3600``."""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import SplitResult, parse_qsl, urlsplit

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


def split_backend_url(url: str, allowed_params: Iterable[str]) -> tuple[SplitResult, dict[str, str]]:
    """Split ``url`` and return its parts and query parameters; unknown or repeated parameters are a ValueError."""
    parts = urlsplit(url)
    allowed = set(allowed_params)
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in allowed:
            raise ValueError(
                f"unknown parameter {name!r} in {parts.scheme}:// URL {url!r}; allowed: {sorted(allowed)}"
            )
        if name in params:
            raise ValueError(f"parameter {name!r} given twice in {url!r}")
        params[name] = value
    return parts, params
