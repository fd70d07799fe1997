"""What the bulk channel's client raises: the call could not go over the bulk channel
(:class:`BulkUnavailable`: the gRPC tier retries it over gRPC), or the server refused it
(:class:`BulkStatusError`, with the gRPC status number it answered)."""

from __future__ import annotations

from protos.bulk_wire import STATUS_NAMES


class BulkUnavailable(Exception):
    """The bulk channel could not carry the call (transport failure); retry it over gRPC."""


class BulkStatusError(Exception):
    """The server answered with an error status (``code``, a gRPC status number) and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{STATUS_NAMES.get(code, code)}: {message}")
        self.code = code
        self.message = message
