"""Bearer-token check for every kvstash RPC (data and admin); health and reflection stay open.

Clients send ``authorization: Bearer TOKEN`` metadata. The interceptor runs once
per call, before the handler, and changes nothing but the call's outcome.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

#: methods of these services need the token; others (health, reflection) do not
PROTECTED_PREFIX = "/kvstash.v1."
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token"


async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(_refuse, **kwargs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses kvstash calls whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the auth token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        # Constant-time comparison: response timing must not reveal the token.
        if hmac.compare_digest(given_bytes, self._expected):
            return handler
        return _refusing_handler(handler)
