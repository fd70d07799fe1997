"""The committed stubs match protos/kvstash.proto and import with older grpcio/protobuf runtimes."""

from __future__ import annotations

import re
import subprocess
import sys

from benchmarks.support.cache_server_process import REPO_ROOT

STUB_NAMES = ("kvstash_pb2.py", "kvstash_pb2_grpc.py", "kvstash_pb2.pyi")


def _normalized(text: str) -> str:
    # The protoc version comment is the one line another grpcio-tools release may change.
    return re.sub(r"^# Protobuf Python Version:.*\n", "", text, flags=re.MULTILINE)


def test_committed_stubs_are_up_to_date(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for name in STUB_NAMES:
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (REPO_ROOT / "protos" / name).read_text()
        assert _normalized(fresh) == _normalized(committed), (
            f"protos/{name} is stale: run `make protos` (python scripts/gen_protos.py) and commit the result"
        )


def test_stubs_import_from_the_repo_root_and_accept_older_runtimes() -> None:
    from protos import kvstash_pb2, kvstash_pb2_grpc

    assert kvstash_pb2.DESCRIPTOR.package == "kvstash.v1"
    assert set(kvstash_pb2.DESCRIPTOR.services_by_name) == {"KVCache", "Admin"}
    assert kvstash_pb2_grpc.KVCacheStub and kvstash_pb2_grpc.AdminStub
    # The runtime checks are lowered to pyproject's minimums, so newer-than-minimum runtimes import them.
    grpc_stub = (REPO_ROOT / "protos" / "kvstash_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.62.0'" in grpc_stub
    pb2 = (REPO_ROOT / "protos" / "kvstash_pb2.py").read_text()
    assert re.search(r"Domain\.PUBLIC,\s*5,\s*26,\s*0,", pb2)
