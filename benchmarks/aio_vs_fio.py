"""Our aio engine against fio: sequential O_DIRECT write then read of the same file size.

    python benchmarks/aio_vs_fio.py --dir /tmp --size 4GiB --rounds 3

fio runs with its best sequential O_DIRECT setting here, bs=1M iodepth=8, on libaio or io_uring,
whichever a probe run finds faster (--fio-engine picks one). Runs alternate A (ours) B (fio) per
round so that both sides see the same background load; the JSON printed at the end holds every run,
both medians, the ratio of medians and the median of the per-round ratios, ours/fio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
OURS_SETTINGS = ("block_bytes", "queue_depth", "workers", "backend", "o_direct")


def ensure_fio() -> str:
    fio = shutil.which("fio")
    if fio is None:
        print("fio missing: apt-get update && apt-get install -y fio", file=sys.stderr)
        subprocess.run(["apt-get", "update"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "fio"], check=True, stdout=subprocess.DEVNULL)
        fio = shutil.which("fio")
    if fio is None:
        raise SystemExit("fio is not installed and could not be installed")
    return fio


def run_fio(fio: str, folder: str, size_bytes: int, engine: str) -> dict[str, float]:
    path = os.path.join(folder, f"fio-{os.getpid()}.tmp")
    result: dict[str, float] = {}
    try:
        for rw in ("write", "read"):
            cmd = [
                fio,
                "--name=seq",
                f"--filename={path}",
                f"--rw={rw}",
                "--bs=1M",
                "--iodepth=8",
                f"--ioengine={engine}",
                "--direct=1",
                f"--size={size_bytes}",
                "--numjobs=1",
                "--output-format=json",
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            job = json.loads(out[out.index("{") :])["jobs"][0]
            if job.get("error"):
                raise RuntimeError(f"fio {engine} {rw} failed: error {job['error']}")
            result[f"{rw}_gbps"] = round(job[rw]["bw_bytes"] / 1e9, 3)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return result


def run_ours(folder: str, size_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "zeroinf.aio.bench",
        "--dir",
        folder,
        "--size",
        str(size_bytes),
        "--block-bytes",
        args.block_bytes,
        "--queue-depth",
        str(args.queue_depth),
        "--workers",
        str(args.workers),
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def pick_fio_engine(fio: str, folder: str, size_bytes: int) -> tuple[str, dict[str, Any]]:
    probe: dict[str, Any] = {}
    for engine in ("libaio", "io_uring"):
        try:
            probe[engine] = run_fio(fio, folder, size_bytes, engine)
        except (subprocess.CalledProcessError, RuntimeError) as exc:
            probe[engine] = {"error": str(exc)[:200]}
    usable = {e: r for e, r in probe.items() if "error" not in r}
    if not usable:
        raise SystemExit(f"fio failed with both engines: {probe}")
    best = max(usable, key=lambda e: math.sqrt(usable[e]["read_gbps"] * usable[e]["write_gbps"]))
    return best, probe


def summarize(ours: list[dict[str, Any]], fio: list[dict[str, float]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for rw in ("read", "write"):
        a = [r[f"{rw}_gbps"] for r in ours]
        b = [r[f"{rw}_gbps"] for r in fio]
        summary[f"ours_{rw}_gbps_median"] = round(statistics.median(a), 3)
        summary[f"fio_{rw}_gbps_median"] = round(statistics.median(b), 3)
        summary[f"ratio_{rw}_of_medians"] = round(statistics.median(a) / statistics.median(b), 3)
        summary[f"ratio_{rw}_paired_median"] = round(
            statistics.median(x / y for x, y in zip(a, b, strict=True)), 3
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="folder on the disk (default: a new folder in /tmp)")
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--rounds", type=int, default=3, help="A B pairs (default: %(default)s)")
    parser.add_argument("--fio-engine", choices=("auto", "libaio", "io_uring"), default="auto")
    parser.add_argument("--block-bytes", default="1MiB", help="our engine's block size")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(SRC))
    from zeroinf.memory import parse_bytes

    size_bytes = parse_bytes(args.size)
    fio = ensure_fio()
    folder = args.dir or tempfile.mkdtemp(prefix="zeroinf-aio-vs-fio-", dir="/tmp")
    try:
        if args.fio_engine == "auto":
            engine, probe = pick_fio_engine(fio, folder, size_bytes)
        else:
            engine, probe = args.fio_engine, {}
        ours_runs: list[dict[str, Any]] = []
        fio_runs: list[dict[str, float]] = []
        for i in range(args.rounds):
            ours_runs.append(run_ours(folder, size_bytes, args))
            fio_runs.append(run_fio(fio, folder, size_bytes, engine))
            print(
                f"round {i}: ours {ours_runs[-1]['write_gbps']}/{ours_runs[-1]['read_gbps']} "
                f"fio {fio_runs[-1]['write_gbps']}/{fio_runs[-1]['read_gbps']} GB/s (write/read)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()
    report = {
        "size_bytes": size_bytes,
        "rounds": args.rounds,
        "mode": "sequential, O_DIRECT, write then read",
        "fio": {"version": fio_version, "ioengine": engine, "bs": "1M", "iodepth": 8, "probe": probe},
        "ours": {k: ours_runs[0][k] for k in OURS_SETTINGS},
        **summarize(ours_runs, fio_runs),
        "runs": [
            {"ours": {k: o[k] for k in ("write_gbps", "read_gbps")}, "fio": f}
            for o, f in zip(ours_runs, fio_runs, strict=True)
        ],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
