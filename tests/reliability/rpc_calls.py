"""Every RPC of the cache server, called through a generic channel with raw bytes.

The request bytes go out as they are (identity serializers), so a test can send
well-formed messages, hypothesis-generated ones or plain garbage to any method
and look only at the status code. The method list comes from the proto
descriptor, so a new RPC is covered without editing the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import grpc
from google.protobuf.message import Message

from protos import kvstash_pb2


class Method(NamedTuple):
    path: str  # "/kvstash.v1.KVCache/Put"
    name: str
    request_class: type[Message]
    client_streaming: bool
    server_streaming: bool


METHODS: tuple[Method, ...] = tuple(
    Method(
        f"/{service.full_name}/{method.name}",
        method.name,
        getattr(kvstash_pb2, method.input_type.name),
        method.client_streaming,
        method.server_streaming,
    )
    for service in kvstash_pb2.DESCRIPTOR.services_by_name.values()
    for method in service.methods
)


def raw_call(
    channel: grpc.Channel,
    method: Method,
    messages: Sequence[bytes],
    metadata: tuple = (),
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, str]:
    """Send ``messages`` (serialized requests; one for unary-request methods) and return
    the call's status code and details; a streamed answer is read to its end."""
    try:
        if method.client_streaming:
            channel.stream_unary(method.path)(iter(messages), timeout=timeout_s, metadata=metadata)
        elif method.server_streaming:
            for _ in channel.unary_stream(method.path)(messages[0], timeout=timeout_s, metadata=metadata):
                pass
        else:
            channel.unary_unary(method.path)(messages[0], timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def sample_request(method: Method, key: str, value: bytes) -> list[bytes]:
    """A well-formed request for ``method`` about ``key`` (Put stores ``value``)."""
    if method.name == "Put":
        return [kvstash_pb2.PutRequest(key=key, total_size=len(value), data=value).SerializeToString()]
    fields = {"Contains": {"keys": [key]}, "ListKeys": {"prefix": key[:4]}}.get(method.name)
    if fields is None:
        fields = {"key": key} if "key" in method.request_class.DESCRIPTOR.fields_by_name else {}
    return [method.request_class(**fields).SerializeToString()]
