"""Tenants of one cache server: who may touch which keys (docs/architecture.md, Cache
server and protos; issue #17).

``kvstash cache-server --tenants FILE`` reads a YAML list of
``{name, token, prefixes: [...], admin: bool}``. A request's bearer token names
its tenant; the tenant may Put, Get, Contains, Delete, Info, Evict and ListKeys
only keys that start with one of its prefixes (anything else is
PERMISSION_DENIED), and only an admin may Clear everything or read the
server-wide Stats. An admin may touch every key. ``--auth-token TOKEN`` is one
admin tenant named ``auth-token``; given with ``--tenants`` it is added to the
file's tenants. With neither, the server is open: every caller is an admin.

Built once at start-up (:func:`load_tenants`, :class:`TenantRegistry`), then
read-only; the gRPC handlers and the bulk channel's threads share it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: name of the admin tenant that ``--auth-token`` stands for
AUTH_TOKEN_TENANT = "auth-token"
#: the fields of one tenant entry in the YAML file
TENANT_FIELDS = frozenset({"name", "token", "prefixes", "admin"})
#: shortest token accepted in a tenants file (a guessable token is no tenant boundary)
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class Tenant:
    """One tenant. ``prefixes`` are plain text key prefixes (no patterns)."""

    name: str
    token: str
    prefixes: tuple[str, ...] = ()
    admin: bool = False

    def may_access_key(self, key: str) -> bool:
        """Whether this tenant may read, write or delete ``key``."""
        return self.admin or key.startswith(self.prefixes)

    def may_list_prefix(self, prefix: str) -> bool:
        """Whether every key that starts with ``prefix`` is this tenant's (list or evict them)."""
        return self.admin or (bool(prefix) and prefix.startswith(self.prefixes))

    def denied(self, what: str) -> str:
        """The PERMISSION_DENIED message for ``what`` (names the tenant, never its token)."""
        allowed = ", ".join(repr(prefix) for prefix in self.prefixes) or "none"
        return f"tenant {self.name!r} may not {what} (its key prefixes: {allowed})"


#: the caller of a server without authentication: may do everything
OPEN_ACCESS = Tenant(name="anonymous", token="", prefixes=(), admin=True)


class TenantRegistry:
    """Tokens to tenants. ``tenant_for_token`` compares digests of equal length against
    every tenant's token in constant time (no early exit), so response timing reveals
    neither a token, its length, nor which tenant matched."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        check_tenants(tenants)
        self.tenants = tuple(tenants)
        self._token_digests = [_digest(tenant.token.encode()) for tenant in self.tenants]

    def tenant_for_token(self, token: bytes | str) -> Tenant | None:
        """The tenant whose token is ``token``, None when there is none."""
        given = _digest(token.encode() if isinstance(token, str) else bytes(token))
        found = None
        for tenant, expected in zip(self.tenants, self._token_digests, strict=True):
            if hmac.compare_digest(given, expected):
                found = tenant
        return found

    def tenant_for_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """The tenant of a gRPC call's ``authorization: Bearer TOKEN`` metadata, or None."""
        given = dict(metadata or ()).get("authorization", "")
        given = given.decode(errors="replace") if isinstance(given, bytes) else given
        if not given.startswith("Bearer "):
            return None
        return self.tenant_for_token(given[len("Bearer ") :])


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def check_tenants(tenants: Sequence[Tenant]) -> None:
    """ValueError naming the first problem: no tenant, an empty or duplicate name or token,
    a non-admin without prefixes, an empty prefix."""
    if not tenants:
        raise ValueError("no tenants: the list is empty")
    names: set[str] = set()
    tokens: set[str] = set()
    for tenant in tenants:
        if not tenant.name:
            raise ValueError("a tenant has an empty name")
        if tenant.name in names:
            raise ValueError(f"tenant name {tenant.name!r} appears twice")
        if not tenant.token.strip():
            raise ValueError(f"tenant {tenant.name!r} has an empty token")
        if tenant.token in tokens:
            raise ValueError(f"tenant {tenant.name!r} has the same token as an earlier tenant")
        if any(not prefix for prefix in tenant.prefixes):
            raise ValueError(f"tenant {tenant.name!r} has an empty prefix (it would match every key)")
        if not tenant.admin and not tenant.prefixes:
            raise ValueError(f"tenant {tenant.name!r} is not an admin and has no prefixes")
        names.add(tenant.name)
        tokens.add(tenant.token)


def load_tenants(path: str | os.PathLike[str]) -> list[Tenant]:
    """Read and validate a tenants file; ValueError with the file and the entry at fault."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except OSError as error:
        raise ValueError(f"cannot read tenants file {str(path)!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"tenants file {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(data, list):
        raise ValueError(f"tenants file {str(path)!r} must hold a list of {{name, token, prefixes, admin}}")
    tenants = [_tenant_from_entry(entry, index, path) for index, entry in enumerate(data)]
    try:
        check_tenants(tenants)
    except ValueError as error:
        raise ValueError(f"tenants file {str(path)!r}: {error}") from None
    return tenants


def _tenant_from_entry(entry: object, index: int, path: str | os.PathLike[str]) -> Tenant:
    where = f"tenants file {str(path)!r}, entry {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a mapping with name, token, prefixes and admin")
    unknown = sorted(str(key) for key in set(entry) - TENANT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    name, token = entry.get("name"), entry.get("token")
    prefixes, admin = entry.get("prefixes", []), entry.get("admin", False)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string")
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where} ({name}): token must be a string of at least {MIN_TOKEN_CHARS} characters")
    if not isinstance(prefixes, list) or not all(isinstance(prefix, str) for prefix in prefixes):
        raise ValueError(f"{where} ({name}): prefixes must be a list of strings")
    if not isinstance(admin, bool):
        raise ValueError(f"{where} ({name}): admin must be true or false")
    return Tenant(name=name, token=token, prefixes=tuple(prefixes), admin=admin)


def build_registry(tenants: Sequence[Tenant], auth_token: str | None) -> TenantRegistry | None:
    """The server's registry: the file's tenants plus an admin tenant for ``auth_token``;
    None (an open server) with neither."""
    everyone = list(tenants)
    if auth_token:
        everyone.append(Tenant(name=AUTH_TOKEN_TENANT, token=auth_token, prefixes=(), admin=True))
    if not everyone:
        return None
    if any(tenant.name == AUTH_TOKEN_TENANT for tenant in tenants) and auth_token:
        raise ValueError(f"a tenant is named {AUTH_TOKEN_TENANT!r}, the name that --auth-token takes")
    return TenantRegistry(everyone)
