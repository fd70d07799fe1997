"""Importing NIXL, the transfer library of the direct path (``pip install 'kvstash[nixl]'``),
and whether an engine uses that path. No torch here: the CLI checks its flags with it
before anything heavy loads (the NIXL wheel itself imports torch when it is asked for).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

#: the wheels' import names, newest build first (nixl-cu13, nixl-cu12, the plain package)
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")


def import_nixl() -> ModuleType:
    """The NIXL module; ImportError saying how to install it when no wheel is installed."""
    errors = []
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        errors.append(f"{name}: no nixl_agent")
    raise ImportError(
        "the direct KV path needs NIXL (pip install 'kvstash[nixl]', i.e. nixl-cu13): " + "; ".join(errors)
    )


def nixl_available() -> bool:
    """Whether NIXL imports (what ``kv_transfer`` "auto" asks)."""
    try:
        import_nixl()
    except ImportError:
        return False
    return True


def wants_direct(kv_transfer: str, *, cpu_bytes: int, split: bool) -> bool:
    """Whether an engine of a P/D role makes a NIXL agent (``kv_transfer``: an
    ``OffloadConfig.kv_transfer``): "shared" never; "direct" always, or ValueError saying
    what it lacks; "auto" where it would work (NIXL imports, a CPU tier, one process)."""
    if kv_transfer == "shared":
        return False
    lacks = []
    if cpu_bytes <= 0:
        lacks.append("a CPU tier (cpu_bytes > 0: its memory is what NIXL reads and writes)")
    if split:
        lacks.append("an engine in one process (no pipeline stages or tensor-parallel ranks)")
    if not lacks:
        try:
            import_nixl()
        except ImportError as error:
            lacks.append(str(error))
    if lacks and kv_transfer == "direct":
        raise ValueError("kv_transfer 'direct' needs " + " and ".join(lacks))
    if lacks:
        log.info(
            "P/D: the direct path is off (it needs %s); hand-overs go through the shared tier",
            "; ".join(lacks),
        )
    return not lacks
