"""gRPC channels to a kvstash cache server: message limits, reconnect backoff, TLS, the token.

Used by the ``grpc://`` tier, ``kvstash admin``, the server (its message limits)
and the tests. Pure construction; no calls are made here.
"""

from __future__ import annotations

import grpc

from storage_backends.grpc_codec import PIECE_BYTES

#: the largest message either side accepts: a piece plus framing, with room to spare
MAX_MESSAGE_BYTES = 8 * PIECE_BYTES
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
#: client channels retry a lost server at least once a second (gRPC's default backoff grows
#: to 120 s, so hits would come back minutes after a restarted server is up again)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
AUTH_TOKEN_ENV = "KVSTASH_AUTH_TOKEN"


def make_channel(address: str, *, secure: bool, ca_path: str | None = None) -> grpc.Channel:
    """A channel to ``address`` ("host:port"), TLS when ``secure`` (trusting ``ca_path`` or the system roots)."""
    if not secure:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
    root_certificates = None
    if ca_path is not None:
        try:
            with open(ca_path, "rb") as ca_file:
                root_certificates = ca_file.read()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS CA file {ca_path}: {exc.strerror}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
