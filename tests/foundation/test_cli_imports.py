"""The fast CLI (issue 35): ``kvstash --help``, ``kvstash admin ...`` and the cache server
start without importing torch, and the lazy root group reads as the eager one did.

Each check runs a real child process: the ``kvstash`` command itself (``python -m
engine.cli``) or a cache server started for real, whose memory map is read to see what
it loaded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import click
import pytest

from benchmarks.support.cache_server_process import REPO_ROOT, CacheServerProcess, repo_env
from benchmarks.support.cache_server_values import make_value
from engine.cli import LAZY_SUBCOMMANDS, main
from tests.cache_server.helpers import Stubs
from tests.cache_server.server_process import kvstash_command

#: runs ``kvstash ARGS`` (argv[1:]) in this process, then prints which heavy modules it imported
_RUN_AND_REPORT = """
import sys
from engine.cli import main
try:
    main(sys.argv[1:], prog_name="kvstash")
except SystemExit as exit_:
    code = exit_.code
else:
    code = 0
print("IMPORTED torch=%s numpy=%s" % ("torch" in sys.modules, "numpy" in sys.modules))
sys.exit(code)
"""


def run_kvstash_reporting_imports(*args: str) -> tuple[subprocess.CompletedProcess, str]:
    """``kvstash ARGS`` in a fresh interpreter -> (the finished process, its ``IMPORTED ...`` line)."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AND_REPORT, *args],
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = [line for line in result.stdout.splitlines() if line.startswith("IMPORTED ")]
    assert report, f"no import report (exit {result.returncode}): {result.stderr[-2000:]}"
    return result, report[-1]


def mapped_libraries(pid: int) -> str:
    """The file names a live process has mapped (``/proc/PID/maps``)."""
    return Path(f"/proc/{pid}/maps").read_text()


def assert_loaded_neither_torch_nor_numpy(pid: int) -> None:
    """A live process maps no libtorch and no numpy core, and the check can see what it
    loaded: gRPC's own library is there."""
    maps = mapped_libraries(pid)
    assert "libtorch" not in maps and "_multiarray_umath" not in maps
    assert "cygrpc" in maps


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")


def test_help_lists_every_command_without_torch() -> None:
    result, imported = run_kvstash_reporting_imports("--help")
    assert result.returncode == 0, result.stderr
    for name in (*LAZY_SUBCOMMANDS, "make-tiny-model"):
        assert f"\n  {name} " in result.stdout, name
    assert imported == "IMPORTED torch=False numpy=False"


def test_lazy_help_reads_as_the_eager_group() -> None:
    """``kvstash --help`` from the kept summaries equals what click writes with every command
    imported and attached: a command whose help changed without its copy fails here."""
    eager = click.Group(main.name, params=main.params, help=main.help, context_settings=main.context_settings)
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        assert isinstance(command, click.Command) and command.name == name
        eager.add_command(command, name)
    # contexts as `kvstash` makes them (its context settings: -h and --help); click keeps a
    # command's help option once made, so an earlier test's `main` run must not differ from this
    lazy_help = main.get_help(click.Context(main, info_name="kvstash", **main.context_settings))
    assert lazy_help == eager.get_help(click.Context(eager, info_name="kvstash", **eager.context_settings))
    for name, lazy in LAZY_SUBCOMMANDS.items():
        command = main.get_command(ctx, name)
        assert command.help.split("\n\n")[0].split() == lazy.summary.split(), name


def test_the_router_imports_no_torch() -> None:
    """`kvstash router` hashes prompts and speaks HTTP: its command and its whole app (index,
    matching, ranking, forwarding) import no torch (only loading a tokenizer may)."""
    result, imported = run_kvstash_reporting_imports("router", "--help")
    assert result.returncode == 0 and "--replica-events" in result.stdout, result.stderr
    assert imported.startswith("IMPORTED torch=False")
    app = "import sys, engine.server.router.app; print('torch' in sys.modules)"
    check = subprocess.run(
        [sys.executable, "-c", app],
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.stdout.strip() == "False", check.stderr


def test_unknown_command_is_refused_without_importing_anything() -> None:
    result, imported = run_kvstash_reporting_imports("no-such-command")
    assert result.returncode == 2 and "No such command 'no-such-command'" in result.stderr
    assert imported == "IMPORTED torch=False numpy=False"


def test_admin_against_a_real_server_imports_no_torch(cache_server, cache_server_url) -> None:
    from storage_backends.grpc_backend import GrpcBackend

    backend = GrpcBackend.from_url(cache_server_url)
    try:
        backend.put_encoded("fastcli/0", make_value(0, key="fastcli/0"))
    finally:
        backend.close()
    for args in (("health",), ("stats",), ("info", "fastcli/0"), ("ls", "--json")):
        result, imported = run_kvstash_reporting_imports("admin", "--server", cache_server.address, *args)
        assert result.returncode == 0, (args, result.stderr)
        assert imported == "IMPORTED torch=False numpy=False", args
    assert "fastcli/0" in result.stdout


@needs_proc
def test_kvstash_cache_server_stores_and_serves_without_torch(tmp_path) -> None:
    """The real ``kvstash cache-server`` command: after Puts and Gets over gRPC and the bulk
    channel (values assembled and checksummed by the server), no torch library is mapped."""
    from storage_backends.grpc_backend import GrpcBackend

    process = _start_kvstash_cache_server("--memory-gb", "0.25")
    try:
        first_line = _first_line(process)
        assert "listening on grpc://" in first_line, first_line + process.stderr.read()
        url = first_line.strip().split("listening on ", 1)[1].split()[0]
        values = {
            f"fastcli/{i}": make_value(i, num_bytes=(1 << 20) * i + 4096, key=f"fastcli/{i}")
            for i in range(3)
        }
        for bulk in ("", "?bulk=off"):
            backend = GrpcBackend.from_url(url + bulk)
            try:
                for key, value in values.items():
                    backend.put_encoded(key, value)
                    assert bytes(backend.get_encoded(key)) == value
            finally:
                backend.close()
        assert_loaded_neither_torch_nor_numpy(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)


@needs_proc
def test_kvstash_cache_server_with_a_disk_tier_stores_and_serves_without_torch(tmp_path) -> None:
    """The real ``kvstash cache-server`` with a disk tier and a memory tier too small for two
    values: each Get below, over the bulk channel and over gRPC, reads its value back from
    disk (direct I/O on the big ones: ext4 accepts it), and still no torch or numpy library
    is mapped."""
    from protos import kvstash_pb2
    from storage_backends.grpc_backend import GrpcBackend

    disk_path = tmp_path / "disk"
    # 4 MiB of memory: one 3 MiB value fits, two do not
    process = _start_kvstash_cache_server(
        "--memory-gb", "0.004", "--disk-path", str(disk_path), "--disk-gb", "0.25"
    )
    try:
        first_line = _first_line(process)
        assert "listening on grpc://" in first_line, first_line + process.stderr.read()
        url = first_line.strip().split("listening on ", 1)[1].split()[0]
        values = {
            "fastcli/disk/big0": make_value(10, num_bytes=(3 << 20) + 100, key="fastcli/disk/big0"),
            "fastcli/disk/big1": make_value(11, num_bytes=(3 << 20) + 100, key="fastcli/disk/big1"),
            "fastcli/disk/small": make_value(12, num_bytes=4096, key="fastcli/disk/small"),
        }
        for bulk in ("", "?bulk=off"):
            backend = GrpcBackend.from_url(url + bulk)
            try:
                for key, value in values.items():
                    backend.put_encoded(key, value)
                # big1's Put evicted big0 from memory, and each disk hit evicts the other
                for key in ("fastcli/disk/big0", "fastcli/disk/big1", "fastcli/disk/big0"):
                    assert bytes(backend.get_encoded(key)) == values[key], (bulk, key)
            finally:
                backend.close()
        with Stubs(url.split("://", 1)[1]) as stubs:
            stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=30)
        disk = next(tier for tier in stats.tiers if tier.name == "disk")
        assert disk.hits >= 6 and disk.verified == disk.hits and disk.corrupt == 0, disk
        assert len(list(disk_path.glob("*.kvc"))) == len(values)
        assert_loaded_neither_torch_nor_numpy(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)


@needs_proc
def test_python_m_cache_server_imports_no_torch() -> None:
    server = CacheServerProcess().start()
    try:
        maps = mapped_libraries(server.process.pid)
        assert "cygrpc" in maps and "libtorch" not in maps
    finally:
        server.stop()


def _start_kvstash_cache_server(*args: str) -> subprocess.Popen:
    """``kvstash cache-server --port 0 ARGS`` as a child process (text pipes for its output)."""
    return subprocess.Popen(
        kvstash_command("cache-server", "--port", "0", *args),
        cwd=REPO_ROOT,
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _first_line(process: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The child's first line of stdout, or "" when none comes within ``timeout_s``."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""
