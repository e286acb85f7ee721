"""Checkpoint save (and load) speed against the disk's own write bandwidth, measured in the same run.

    PYTHONPATH=src python benchmarks/checkpoint_io.py --dir /mnt/nvme/ckpt --params 1e9

Builds a model of `--params` fp32 parameters (square Linear layers, stage 2, world 1, states in
memory), takes one optimizer step so every state is non-trivial, saves a checkpoint (fp32 master +
exp_avg + exp_avg_sq = 12 bytes per parameter, plus fsync and the atomic renames), loads it back,
and measures the disk with `zeroinf.aio.bench.measure` (O_DIRECT writes of the same size, capped by
--disk-bytes). Prints one JSON object: save and load bytes/s and the ratio save / disk write.
Memory: about 20 bytes per parameter (1e9 parameters need ~20 GB of RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

import zeroinf
import zeroinf.checkpoint as ck
from zeroinf.aio import AioConfig
from zeroinf.aio.bench import measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--params", type=float, default=1e9, help="number of parameters (default 1e9)")
    parser.add_argument("--dim", type=int, default=4096, help="width of the square layers")
    parser.add_argument("--disk-bytes", type=float, default=4e9, help="most bytes for the disk measurement")
    args = parser.parse_args(argv)
    folder = args.dir or tempfile.mkdtemp(prefix="zeroinf-ckpt-bench-")
    os.makedirs(folder, exist_ok=True)
    layers = max(1, round(args.params / (args.dim * args.dim)))
    torch.manual_seed(0)
    with zeroinf.init():
        model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim, bias=False) for _ in range(layers)])
    model = zeroinf.shard(model, zeroinf.Config(stage=2))
    opt = zeroinf.AdamW(model, lr=1e-4)
    opt.backward(model(torch.randn(1, args.dim)).square().mean())
    opt.step()
    opt.zero_grad()
    root = os.path.join(folder, "ckpt")
    try:
        t0 = time.perf_counter()
        path = ck.save(root, model, opt, step=1)
        save_s = time.perf_counter() - t0
        nbytes = ck.verify(path)["bytes"]
        t0 = time.perf_counter()
        ck.load(root, model, opt)
        load_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    disk = measure(folder, int(min(nbytes, args.disk_bytes)), AioConfig())
    save_bps = nbytes / save_s
    print(json.dumps({
        "params": layers * args.dim * args.dim,
        "checkpoint_bytes": nbytes,
        "save_s": round(save_s, 3),
        "save_bytes_per_s": round(save_bps),
        "load_s": round(load_s, 3),
        "load_bytes_per_s": round(nbytes / load_s),
        "disk_write_bytes_per_s": round(disk["write_gbps"] * 1e9),
        "disk_read_bytes_per_s": round(disk["read_gbps"] * 1e9),
        "save_vs_disk_write": round(save_bps / (disk["write_gbps"] * 1e9), 3),
        "disk": disk,
    }))
    if args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
