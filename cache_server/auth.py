"""Bearer-token check for every kvstash RPC (data and admin); health and reflection stay open.

Clients send ``authorization: Bearer TOKEN`` metadata. The interceptor runs once
per call, before the handler, and changes nothing but the call's outcome: a token
of no tenant (``cache_server.tenants``) is UNAUTHENTICATED. What a known tenant
may do is the handlers' check (PERMISSION_DENIED).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from cache_server.tenants import TenantRegistry

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
    """Refuses kvstash calls whose ``authorization`` metadata is not ``Bearer <a tenant's token>``."""

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(PROTECTED_PREFIX):
            return handler
        # Constant-time comparisons: response timing must not reveal a token.
        if self._registry.tenant_for_metadata(handler_call_details.invocation_metadata) is not None:
            return handler
        return _refusing_handler(handler)
