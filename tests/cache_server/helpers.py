"""Helpers for the cache server tests: raw stubs, CLI runs (valid values: benchmarks.support.cache_server_values)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import grpc

from benchmarks.support.cache_server_process import REPO_ROOT, repo_env
from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.grpc_channel import make_channel
from storage_backends.grpc_codec import PIECE_BYTES
from tests.cache_server.server_process import kvstash_command


def put_requests(key: str, data: bytes) -> Iterator[kvstash_pb2.PutRequest]:
    """A Put stream built from generated message objects, as any generic client would."""
    yield kvstash_pb2.PutRequest(key=key, total_size=len(data), data=data[:PIECE_BYTES])
    for start in range(PIECE_BYTES, len(data), PIECE_BYTES):
        yield kvstash_pb2.PutRequest(data=data[start : start + PIECE_BYTES])


def join_pieces(responses: Iterator[kvstash_pb2.GetResponse]) -> bytes:
    """The value of a Get stream read through generated message objects."""
    responses = list(responses)
    data = b"".join(response.data for response in responses)
    assert responses[0].total_size == len(data), "total_size on the first message must be the value's length"
    return data


class Stubs:
    """Generated KVCache and Admin stubs (the generic-client path, unlike the grpc backend's wire path)."""

    def __init__(self, address: str, *, metadata: tuple = (), tls_ca: str | None = None) -> None:
        self.channel = make_channel(address, secure=tls_ca is not None, ca_path=tls_ca)
        self.kv = kvstash_pb2_grpc.KVCacheStub(self.channel)
        self.admin = kvstash_pb2_grpc.AdminStub(self.channel)
        self.metadata = metadata

    def put(self, key: str, data: bytes) -> kvstash_pb2.PutResponse:
        return self.kv.Put(put_requests(key, data), timeout=60, metadata=self.metadata)

    def get(self, key: str) -> bytes:
        return join_pieces(self.kv.Get(kvstash_pb2.GetRequest(key=key), timeout=60, metadata=self.metadata))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Stubs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status_of(call) -> grpc.StatusCode:
    """Run ``call()`` expecting an RpcError; return its code."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    raise AssertionError("the call succeeded but was expected to fail")


def rpc_error(call) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded but was expected to fail")


def run_kvstash(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Run the ``kvstash`` CLI as a subprocess from the repository root."""
    return subprocess.run(
        kvstash_command(*args),
        cwd=REPO_ROOT,
        env=env or repo_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
