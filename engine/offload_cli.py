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
    OffloadConfig,
    config_from_fields,
    env_values,
    parse_fields,
    read_yaml,
)

#: option name -> OffloadConfig setting (values in the settings' user-facing units)
_OPTION_TO_SETTING = {
    "kv_offload_cpu_gb": "cpu_gb",
    "kv_offload_disk_path": "disk_path",
    "kv_offload_disk_gb": "disk_gb",
    "kv_offload_remote": "remote_url",
    "kv_offload_chunk_size": "chunk_size",
    "kv_offload_codec": "codec",
    "kv_offload_key_prefix": "key_prefix",
}
_SWITCH_ENV = "KVSTASH_KV_OFFLOAD"
_CONFIG_ENV = "KVSTASH_KV_OFFLOAD_CONFIG"

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
        type=float,
        default=None,
        help=f"CPU-memory tier size in GiB; 0 = no CPU tier [default: {OffloadConfig.cpu_bytes / GIB:g}].",
    ),
    click.option(
        "--kv-offload-disk-path", type=click.Path(file_okay=False), default=None, help="Disk tier folder."
    ),
    click.option(
        "--kv-offload-disk-gb",
        type=float,
        default=None,
        help=f"Disk tier size in GiB; needs --kv-offload-disk-path [default: {OffloadConfig.disk_bytes / GIB:g}].",
    ),
    click.option(
        "--kv-offload-remote",
        metavar="URL",
        default=None,
        help="Remote tier: redis://, rediss://, redis+cluster://, rediss+cluster://, grpc:// or grpcs:// URL.",
    ),
    click.option(
        "--kv-offload-chunk-size",
        type=int,
        default=None,
        help=f"Tokens per stored chunk [default: {OffloadConfig.chunk_size}].",
    ),
    click.option(
        "--kv-offload-codec", type=click.Choice(CODECS), default=None, help="Codec of disk and remote values."
    ),
    click.option(
        "--kv-offload-key-prefix",
        metavar="TEXT",
        default=None,
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
    options: dict[str, Any], environ: Mapping[str, str] | None = None
) -> OffloadConfig | None:
    """Pop the offload options from a command's parsed ``options`` and build the config.

    Offload is on when ``--kv-offload``, any other offload flag, a config file or
    ``KVSTASH_KV_OFFLOAD=1`` asks for it. Bad values raise ``ValueError`` naming them.
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
    settings = parse_fields(env_values(environ), source="environment")
    if config_path:
        settings.update(parse_fields(read_yaml(config_path), source=str(config_path)))
    settings.update(parse_fields(flag_settings, source="command line"))
    return config_from_fields(settings, source="offload settings")
