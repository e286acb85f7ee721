"""`zeroinf bench-io`: write then read a file through the engine and report GB/s.

    zeroinf bench-io --dir /nvme/tmp --size 4GiB [--block-bytes 1MiB] [--queue-depth 8] [--workers 8]
    zeroinf bench-io --dir /nvme/tmp --size 4GiB --sweep     # try a small grid, print the best
    python -m zeroinf.aio.bench ...                          # the same, without the CLI wiring

The file is preallocated first (as fio lays its file out), written sequentially in requests of up
to 256 MiB that the engine splits into blocks, then read back; GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any

import xxhash

from zeroinf.aio.buffers import aligned_empty, memoryview_of
from zeroinf.aio.config import AioConfig
from zeroinf.aio.engine import AioEngine
from zeroinf.aio.errors import AioError
from zeroinf.memory import format_bytes, parse_bytes

REQUEST_BYTES = 256 * 1024 * 1024  # one caller request; the engine splits it into blocks
SWEEP_BLOCK_BYTES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
SWEEP_WORKERS = (4, 8, 16)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = AioConfig()
    parser.add_argument("--dir", required=True, help="folder on the disk to measure (a temporary file)")
    parser.add_argument("--size", default="4GiB", help="file size, e.g. 4GiB (default: %(default)s)")
    parser.add_argument(
        "--block-bytes",
        default=str(defaults.block_bytes),
        help="bytes per kernel request, e.g. 1MiB (default: 1MiB)",
    )
    parser.add_argument(
        "--queue-depth",
        type=int,
        default=defaults.queue_depth,
        help="blocks in flight (default: %(default)s)",
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers, help="I/O threads (default: %(default)s)"
    )
    parser.add_argument("--buffered", action="store_true", help="do not use O_DIRECT")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="try block sizes 256KiB/1MiB/4MiB x workers=queue depth 4/8/16; print the best",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def measure(folder: str, size_bytes: int, config: AioConfig) -> dict[str, Any]:
    """Write then read `size_bytes` in `folder`; the file is removed afterwards."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--dir {folder!r} is not a folder")
    size_bytes = -(-size_bytes // config.alignment_bytes) * config.alignment_bytes
    request_bytes = min(size_bytes, REQUEST_BYTES)
    buf = aligned_empty(request_bytes, config.alignment_bytes)
    buf.random_(0, 256)
    path = os.path.join(folder, f"zeroinf-bench-io-{os.getpid()}.tmp")
    offsets = range(0, size_bytes, request_bytes)
    try:
        with AioEngine(config) as engine:
            fd = engine.open_file(path, create=True)
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                raise AioError.from_os_error("fallocate", path, 0, size_bytes, exc) from exc
            write_s = _timed(
                lambda: [engine.write(buf[: min(request_bytes, size_bytes - o)], fd, o) for o in offsets]
            )
            digest = _digest(buf)
            buf.zero_()
            read_s = _timed(
                lambda: [engine.read(buf[: min(request_bytes, size_bytes - o)], fd, o) for o in offsets]
            )
            # Every request carries the same bytes, so the buffer must end as it started.
            if size_bytes % request_bytes == 0 and _digest(buf) != digest:
                raise AioError("read", path, 0, size_bytes, "data read back differs from data written")
            o_direct = engine.is_direct(fd)
            backend = engine.backend_name
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {
        "read_gbps": round(size_bytes / read_s / 1e9, 3),
        "write_gbps": round(size_bytes / write_s / 1e9, 3),
        "size_bytes": size_bytes,
        "block_bytes": config.block_bytes,
        "queue_depth": config.queue_depth,
        "workers": config.workers,
        "backend": backend,
        "o_direct": o_direct,
        "read_s": round(read_s, 4),
        "write_s": round(write_s, 4),
        "dir": os.path.abspath(folder),
    }


def _timed(start: Any) -> float:
    t0 = time.perf_counter()
    for handle in start():
        handle.wait()
    return time.perf_counter() - t0


def _digest(buf: Any) -> int:
    return xxhash.xxh3_64_intdigest(memoryview_of(buf))


def _describe(r: dict[str, Any]) -> str:
    return (
        f"write {r['write_gbps']:.2f} GB/s  read {r['read_gbps']:.2f} GB/s  "
        f"({format_bytes(r['size_bytes'])}, block {format_bytes(r['block_bytes'])}, "
        f"queue depth {r['queue_depth']}, {r['workers']} workers, {r['backend']} backend, "
        f"{'O_DIRECT' if r['o_direct'] else 'buffered'})"
    )


def run(args: argparse.Namespace) -> int:
    """Measure as `args` say; bad values and I/O failures raise (`zeroinf.cli.main` prints them)."""
    size_bytes = parse_bytes(args.size, "--size")
    base = AioConfig(
        block_bytes=parse_bytes(args.block_bytes, "--block-bytes"),
        queue_depth=args.queue_depth,
        workers=args.workers,
        o_direct=not args.buffered,
    )
    if not args.sweep:
        result = measure(args.dir, size_bytes, base)
        print(json.dumps(result) if args.json else _describe(result))
        return 0
    results = []
    for block_bytes in SWEEP_BLOCK_BYTES:
        for workers in SWEEP_WORKERS:
            config = replace(base, block_bytes=block_bytes, queue_depth=workers, workers=workers)
            results.append(measure(args.dir, size_bytes, config))
            if not args.json:
                print(_describe(results[-1]), flush=True)
    # Best by the geometric mean: a setting must be good at both directions.
    best = max(results, key=lambda r: math.sqrt(r["read_gbps"] * r["write_gbps"]))
    lines = config_lines(best)
    if args.json:
        print(json.dumps({"results": results, "best": best, "config_lines": lines}))
    else:
        print(f"best: {_describe(best)}")
        print("to train with it, add these lines to the config file (`zeroinf train --config FILE`, "
              "zeroinf.Config.load), or pass OffloadConfig(aio=AioConfig(...)):")
        print("\n".join(lines))
    return 0


def config_lines(result: dict[str, Any]) -> list[str]:
    """The TOML lines of a training config that apply a measured setting (table `[offload.aio]`)."""
    return [
        "[offload.aio]",
        f"block_bytes = {result['block_bytes']}",
        f"queue_depth = {result['queue_depth']}",
        f"workers = {result['workers']}",
        *([] if result["o_direct"] else ["o_direct = false"]),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m zeroinf.aio.bench ...`: the same as `zeroinf bench-io ...`, errors included."""
    from zeroinf.cli import main as cli_main

    return cli_main(["bench-io", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
