"""Click options that configure KV offloading, shared by `kvstash generate` and `serve`.

`offload_options` adds the `--kv-offload*` flags; `offload_config_from_options`
turns a command's parsed options into an `OffloadConfig` (or None when offload
is off), with the precedence flags > YAML file (`--kv-offload-config`) >
`KVSTASH_KV_OFFLOAD_*` environment variables > defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import click

from connector.config import (
    CODECS,
    GIB,
    LOAD_POLICIES,
    OffloadConfig,
    check_key_prefix,
    config_from_fields,
    env_name,
    env_values,
    parse_fields,
    read_yaml,
)
from connector.cpu_tier_size import AUTO, HostMemory
from storage_backends.urls import check_remote_url

#: option name -> OffloadConfig setting (values in the settings' user-facing units)
_OPTION_TO_SETTING = {
    "kv_offload_cpu_gb": "cpu_gb",
    "kv_offload_disk_path": "disk_path",
    "kv_offload_disk_gb": "disk_gb",
    "kv_offload_remote": "remote_url",
    "kv_offload_chunk_size": "chunk_size",
    "kv_offload_codec": "codec",
    "kv_offload_load_policy": "load_policy",
    "kv_offload_key_prefix": "key_prefix",
    "kv_offload_replicas_per_host": "replicas_per_host",
}
#: OffloadConfig setting -> the flag that sets it (how errors name a flag's value)
_SETTING_TO_FLAG = {setting: "--" + name.replace("_", "-") for name, setting in _OPTION_TO_SETTING.items()}
_SWITCH_ENV = "KVSTASH_KV_OFFLOAD"
_CONFIG_ENV = "KVSTASH_KV_OFFLOAD_CONFIG"


class CpuGiB(click.ParamType):
    """The CPU tier's size: a number of GiB >= 0, or ``auto`` (sized from the host's memory)."""

    name = "GIB|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str | float:
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        try:
            gib = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r}: not a number of GiB nor 'auto'", param, ctx)
        if not 0 <= gib < float("inf"):
            self.fail(f"{value!r}: a size in GiB must be >= 0", param, ctx)
        return gib


class RemoteURL(click.ParamType):
    """A remote tier's URL, checked in full (scheme, host, port, parameters) as the flag is
    parsed, so that a bad one is refused before anything loads, quoting what was typed."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            check_remote_url(value)
        except ValueError as error:
            self.fail(f"{value!r}: {error}", param, ctx)
        return value


def _check_key_prefix(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            check_key_prefix(value)
        except ValueError as error:
            raise click.BadParameter(f"{value!r}: {error}", ctx, param) from None
    return value


def _check_disk_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The disk tier's folder must be one, or creatable: its nearest existing ancestor a
    writable folder (the tier creates it when it opens)."""
    if value is None:
        return value
    if not value.strip():
        raise click.BadParameter(f"{value!r}: an empty path", ctx, param)
    ancestor = os.path.abspath(value)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise click.BadParameter(f"{value!r}: {ancestor!r} is not a folder", ctx, param)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise click.BadParameter(f"{value!r}: cannot write to {ancestor!r}", ctx, param)
    return value


_OPTIONS = [
    click.option(
        "--kv-offload",
        "kv_offload",
        is_flag=True,
        default=False,
        help=f"Store and reuse KV across CPU memory, disk and a remote tier (or set {_SWITCH_ENV}=1).",
    ),
    click.option(
        "--kv-offload-cpu-gb",
        type=CpuGiB(),
        default=None,
        help=(
            f"CPU-memory tier size in GiB, or 'auto': half of the host's memory less a 10 GiB reserve, "
            f"divided by --kv-offload-replicas-per-host, capped by the memory available; 0 = no CPU tier "
            f"(lower-tier hits are then fetched into a {OffloadConfig.staging_bytes >> 20} MiB staging area) "
            "[default: auto]."
        ),
    ),
    click.option(
        "--kv-offload-replicas-per-host",
        type=click.IntRange(min=1),
        default=None,
        help="Engines on this host that size their CPU tier with 'auto': each takes an equal share [default: 1].",
    ),
    click.option(
        "--kv-offload-disk-path",
        type=click.Path(file_okay=False),
        default=None,
        callback=_check_disk_path,
        help="Disk tier folder (created if missing).",
    ),
    click.option(
        "--kv-offload-disk-gb",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help=f"Disk tier size in GiB; needs --kv-offload-disk-path [default: {OffloadConfig.disk_bytes / GIB:g}].",
    ),
    click.option(
        "--kv-offload-remote",
        type=RemoteURL(),
        default=None,
        help="Remote tier: redis://, rediss://, redis+cluster://, rediss+cluster://, grpc:// or grpcs:// URL.",
    ),
    click.option(
        "--kv-offload-chunk-size",
        type=click.IntRange(min=1),
        default=None,
        help=f"Tokens per stored chunk [default: {OffloadConfig.chunk_size}].",
    ),
    click.option(
        "--kv-offload-codec", type=click.Choice(CODECS), default=None, help="Codec of disk and remote values."
    ),
    click.option(
        "--kv-offload-load-policy",
        type=click.Choice(LOAD_POLICIES),
        default=None,
        help="planned: load a lower-tier hit only where it beats recomputing it; "
        f"always: load every hit [default: {OffloadConfig.load_policy}].",
    ),
    click.option(
        "--kv-offload-key-prefix",
        metavar="TEXT",
        default=None,
        callback=_check_key_prefix,
        help="Text put in front of every chunk key (the tenant's prefix on a cache server with --tenants).",
    ),
    click.option(
        "--kv-offload-config",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help=f"YAML file of OffloadConfig settings (or {_CONFIG_ENV}); flags override it.",
    ),
]


def offload_options(command: Callable) -> Callable:
    """Decorate a click command with the `--kv-offload*` options."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def offload_config_from_options(
    options: dict[str, Any],
    environ: Mapping[str, str] | None = None,
    *,
    host_memory: HostMemory | None = None,
) -> OffloadConfig | None:
    """Pop the offload options from a command's parsed ``options`` and build the config.

    Offload is on when ``--kv-offload``, any other offload flag, a config file or
    ``KVSTASH_KV_OFFLOAD=1`` asks for it. Nothing is opened or connected here. Bad values
    raise ``ValueError`` quoting them as given and where: the flag
    (``--kv-offload-chunk-size 0: ...``), the variable (``KVSTASH_KV_OFFLOAD_REMOTE_URL
    'grpc://h': no port ...``) or the file (``offload config file 'x.yaml': remote_url ...``).
    The commands call it before loading a model, and turn the error into a usage error.

    A CPU tier size given nowhere is ``auto``: sized from ``host_memory`` (default: this
    host's, read now; tests pass their own), less the weights that ``--cpu-offload-gb``
    keeps in host memory (read from ``options``, left there for the engine's flags).
    """
    environ = os.environ if environ is None else environ
    switch = options.pop("kv_offload", False)
    config_path = options.pop("kv_offload_config", None) or environ.get(_CONFIG_ENV)
    flag_settings = {
        setting: value
        for name, setting in _OPTION_TO_SETTING.items()
        if (value := options.pop(name, None)) is not None
    }
    env_switch = environ.get(_SWITCH_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if not (switch or flag_settings or config_path or env_switch):
        return None
    settings = parse_fields(env_values(environ), source="environment", spelled=env_name)
    if config_path:
        settings.update(
            parse_fields(read_yaml(config_path), source=f"offload config file {str(config_path)!r}")
        )
    settings.update(
        parse_fields(flag_settings, source="command line", spelled=lambda name: _SETTING_TO_FLAG[name])
    )
    settings.setdefault("cpu_bytes", AUTO)
    weights_in_host_bytes = int(float(options.get("cpu_offload_gb") or 0) * GIB)
    return config_from_fields(
        settings, source="offload settings", host_memory=host_memory, engine_host_bytes=weights_in_host_bytes
    )
