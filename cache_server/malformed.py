"""Request bytes that are not a protobuf message end with INVALID_ARGUMENT, like other bad input.

gRPC parses a request before the handler runs; when the bytes do not parse,
``grpc.aio`` ends the call with INTERNAL or UNKNOWN and echoes the parser's
exception. This interceptor wraps the request deserializer of every kvstash
method so that a parse failure reaches the method as a marker, and the call ends
with INVALID_ARGUMENT and a one-line message instead. It runs once per call,
before the handler, and changes nothing for requests that parse.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError

#: methods of these services are wrapped; health and reflection keep gRPC's own behaviour
KVSTASH_PREFIX = "/kvstash.v1."


class _Malformed(NamedTuple):
    """Stands in for a request that did not parse."""

    message: str


def _tolerant(deserializer: Callable[[bytes], object], method: str) -> Callable[[bytes], object]:
    def deserialize(data: bytes) -> object:
        try:
            return deserializer(data)
        except DecodeError:
            return _Malformed(f"malformed request to {method}: the bytes are not a valid protobuf message")

    return deserialize


def _checked_iterator(requests, method: str):
    async def checked():
        async for request in requests:
            if isinstance(request, _Malformed):
                # Streaming handlers turn a ValueError into INVALID_ARGUMENT with its message.
                raise ValueError(request.message)
            yield request

    return checked()


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with a tolerant deserializer and a check in front of its behaviour."""
    deserializer = _tolerant(handler.request_deserializer, method)
    if handler.request_streaming:
        inner = handler.stream_unary or handler.stream_stream
        if handler.response_streaming:

            async def stream_stream(requests, context):
                async for response in inner(_checked_iterator(requests, method), context):
                    yield response

            return handler._replace(request_deserializer=deserializer, stream_stream=stream_stream)

        async def stream_unary(requests, context):
            return await inner(_checked_iterator(requests, method), context)

        return handler._replace(request_deserializer=deserializer, stream_unary=stream_unary)
    if handler.response_streaming:
        inner = handler.unary_stream
        if inspect.iscoroutinefunction(inner):
            # A handler that sends with ``context.write`` (e.g. to bound each write by a
            # deadline): gRPC tells the two kinds apart by the function, so keep its kind.

            async def unary_stream_writer(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                await inner(request, context)

            return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream_writer)

        async def unary_stream(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in inner(request, context):
                yield response

        return handler._replace(request_deserializer=deserializer, unary_stream=unary_stream)
    inner = handler.unary_unary

    async def unary_unary(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await inner(request, context)

    return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Turns unparsable kvstash requests into INVALID_ARGUMENT (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.request_deserializer is None or not method.startswith(KVSTASH_PREFIX):
            return handler
        return _wrap(handler, method)
