"""Helpers for the cache server tests: valid values, raw stubs, CLI runs."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from cache_server.config import GIB
from cache_server.memory_tier import entry_size
from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends import create_backend
from storage_backends.chunk import KVChunk, encode_chunk
from storage_backends.grpc_channel import make_channel
from storage_backends.grpc_codec import PIECE_BYTES
from tests.cache_server.server_process import REPO_ROOT, CacheServerProcess, kvstash_command, repo_env


def make_value(seed: int, num_bytes: int = 4096, *, key: str) -> bytes:
    """A valid serialized chunk of about ``num_bytes`` random bytes (uint8 [1, 2, T, 1, 1]), for ``key``."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = max(1, num_bytes // 2)
    return encode_chunk(
        KVChunk(torch.randint(0, 256, (1, 2, num_tokens, 1, 1), dtype=torch.uint8, generator=generator)),
        key=key,
    )


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


def put_all(url: str, keys: Sequence[str], seed: int, num_bytes: int = 64, num_threads: int = 8) -> None:
    """Put a value of ``num_bytes`` made for each key (values bind their key), all of one length,
    through a real grpc tier. Tests and the cache-server benchmarks fill servers with it."""
    backend = create_backend(url)
    try:
        with ThreadPoolExecutor(num_threads) as pool:
            list(pool.map(lambda key: backend.put_encoded(key, make_value(seed, num_bytes, key=key)), keys))
    finally:
        backend.close()


def alternating_tiers_server(disk_path: str, keys: Sequence[str], seed: int) -> CacheServerProcess:
    """A started server whose memory tier holds the even-numbered ``keys`` and whose disk tier
    holds them all: the memory cap fits half; the odd ones are put first and evicted from
    memory by the even ones. The caller stops it."""
    per_entry = entry_size(keys[0], len(make_value(seed, 64, key=keys[0])))
    memory_bytes = (len(keys) // 2) * per_entry + per_entry // 2
    server = CacheServerProcess(
        "--memory-gb", repr(memory_bytes / GIB), "--disk-path", disk_path, "--disk-gb", "1"
    ).start()
    put_all(server.url, keys[1::2], seed, num_threads=1)
    put_all(server.url, keys[0::2], seed, num_threads=1)
    return server
