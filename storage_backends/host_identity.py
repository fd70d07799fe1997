"""Which machine (and which boot of it) this process runs on.

The cache server advertises it with its Unix-socket path (``GetBulkEndpoint``);
the ``grpc://`` tier compares it with its own to decide whether the server is on
the same host, where the bulk channel can use the Unix socket instead of TCP.
``/etc/machine-id`` names the installation, the kernel's boot id the boot; a
container usually has its own machine id, so it is another host unless it
shares the file (and the socket's folder) with the server.
"""

from __future__ import annotations

import functools

MACHINE_ID_PATHS = ("/etc/machine-id", "/var/lib/dbus/machine-id")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def _read_first(paths: tuple[str, ...]) -> str:
    for path in paths:
        try:
            with open(path, encoding="ascii") as file:
                text = file.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            return text
    return ""


@functools.cache
def host_identity() -> str:
    """``"<machine id>/<boot id>"`` (the machine id may be empty: minimal containers lack the
    file), or ``""`` when the boot id is unknown (then no host matches).

    Read once per process (neither changes while it runs). Equal identities are necessary,
    not sufficient: the client also needs the socket file and the server's instance id in its
    HELLO answer (``storage_backends.transport_policy``).
    """
    machine_id = _read_first(MACHINE_ID_PATHS)
    boot_id = _read_first((BOOT_ID_PATH,))
    return f"{machine_id}/{boot_id}" if boot_id else ""
