"""Regenerate the committed gRPC stubs from protos/kvstash.proto.

Run from anywhere: ``python scripts/gen_protos.py`` (or ``make protos``) writes
``protos/kvstash_pb2.py``, ``protos/kvstash_pb2_grpc.py`` and
``protos/kvstash_pb2.pyi``; ``--out DIR`` writes them under ``DIR/protos/``
instead (tests/cache_server/test_protos.py uses that to detect stale stubs).

protoc runs from the repository root with ``-I .`` so the stubs import each
other as ``from protos import kvstash_pb2``.

The generated files pin the exact grpcio/protobuf versions that generated them
and refuse to import under an older runtime. The GPU machines run other (recent)
versions, so the pins are lowered to the minimums that pyproject.toml declares;
the code itself uses nothing newer than those.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO = "protos/kvstash.proto"
STUB_NAMES = ("kvstash_pb2.py", "kvstash_pb2_grpc.py", "kvstash_pb2.pyi")
MIN_GRPC_VERSION = "1.62.0"
MIN_PROTOBUF_VERSION = (5, 26, 0)


def relax_version_pins(name: str, text: str) -> str:
    """Lower the generated runtime-version checks to the supported minimums."""
    if name == "kvstash_pb2_grpc.py":
        text = re.sub(
            r"GRPC_GENERATED_VERSION = '[^']*'", f"GRPC_GENERATED_VERSION = '{MIN_GRPC_VERSION}'", text
        )
    elif name == "kvstash_pb2.py":
        major, minor, patch = MIN_PROTOBUF_VERSION
        text = re.sub(
            r"(_runtime_version\.Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,",
            rf"\g<1>{major},\n    {minor},\n    {patch},",
            text,
        )
        # The header names the protoc version that ran; drop it so that any
        # grpcio-tools release produces the same bytes.
        text = re.sub(r"# Protobuf Python Version: [^\n]*\n", "", text)
    return text


def generate(out_root: Path) -> list[Path]:
    """Run protoc into ``out_root/protos/`` and return the written stub paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            str(REPO_ROOT / PROTO),
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {PROTO}")
        out_dir = out_root / "protos"
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in STUB_NAMES:
            text = (Path(tmp) / "protos" / name).read_text()
            target = out_dir / name
            target.write_text(relax_version_pins(name, text))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="root under which protos/ is written")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
