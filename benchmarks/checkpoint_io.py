"""Checkpoint save and load speed against the disk's own bandwidth, measured in the same run.

    python benchmarks/checkpoint_io.py --params 1e9 --optimizer host --dir /mnt/nvme/ckpt
    python benchmarks/checkpoint_io.py --params 1e9 --optimizer nvme --dir /mnt/nvme/ckpt

Builds a model of `--params` parameters (square bias-free Linear layers) under `zeroinf.init` at
stage 3, world 1, with the compute parameters and gradients on NVMe and the optimizer states on
`--optimizer` (host: 12 bytes per parameter in RAM; nvme: streamed from the swap files during the
save, so the same disk reads and writes at once). Takes one optimizer step so every state is
non-trivial, then alternates `--repeats` times: save a checkpoint (fp32 master + exp_avg +
exp_avg_sq = 12 bytes per parameter, fsync, atomic renames), load it back, then load its masters
alone (`load_optimizer_states=False`: 4 of the 12 bytes; the optimizer's states start fresh). The
disk is measured with
`zeroinf.aio.bench.measure` (the engine `zeroinf bench-io` runs: O_DIRECT, 1 MiB blocks, 8 in
flight) on the same folder right before every round, capped at --disk-bytes. Prints one JSON
object: median save and load bytes/s, the ratios save / disk write and load / disk read of the
medians, and the same ratios per round (each against the disk measured just before it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import machine, peak_rss_bytes  # noqa: E402

import zeroinf  # noqa: E402
import zeroinf.checkpoint as ck  # noqa: E402
from zeroinf.aio import AioConfig  # noqa: E402
from zeroinf.aio.bench import measure  # noqa: E402


def build(params: float, dim: int, optimizer: str, swap_dir: str) -> tuple[torch.nn.Module, zeroinf.AdamW, int]:
    layers = max(1, round(params / (dim * dim)))
    offload = zeroinf.OffloadConfig(params="nvme", gradients="nvme", optimizer=optimizer, nvme_dir=swap_dir)
    cfg = zeroinf.Config(stage=3, offload=offload)
    torch.manual_seed(0)
    with zeroinf.init(cfg):
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    model = zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=1e-4)
    opt.backward(model(torch.randn(1, dim)).square().mean())
    opt.step()
    opt.zero_grad()
    return model, opt, layers * dim * dim


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--params", type=float, default=1e9, help="number of parameters (default 1e9)")
    parser.add_argument("--dim", type=int, default=4096, help="width of the square layers")
    parser.add_argument("--optimizer", choices=("host", "nvme"), default="host", help="where optimizer states live")
    parser.add_argument("--repeats", type=int, default=3, help="save + load rounds")
    parser.add_argument("--disk-bytes", type=float, default=4e9, help="most bytes per disk measurement")
    args = parser.parse_args(argv)
    folder = args.dir or tempfile.mkdtemp(prefix="zeroinf-ckpt-bench-", dir="/tmp")
    os.makedirs(folder, exist_ok=True)
    swap_dir = os.path.join(folder, "swap")
    os.makedirs(swap_dir, exist_ok=True)
    t0 = time.perf_counter()
    model, opt, nparams = build(args.params, args.dim, args.optimizer, swap_dir)
    build_s = time.perf_counter() - t0
    root = os.path.join(folder, "ckpt")
    disk_bytes = int(min(12 * nparams, args.disk_bytes))
    disks = []
    saves, loads, masters_loads, nbytes = [], [], [], 0
    try:
        for r in range(args.repeats):  # the disk's speed drifts: measure it beside every round
            disks.append(measure(folder, disk_bytes, AioConfig()))
            t0 = time.perf_counter()
            path = ck.save(root, model, opt, step=r + 1)
            saves.append(time.perf_counter() - t0)
            nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            t0 = time.perf_counter()
            ck.load(root, model, opt)
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ck.load(root, model, opt, load_optimizer_states=False)
            masters_loads.append(time.perf_counter() - t0)
            print(json.dumps({"round": r, "save_s": saves[-1], "load_s": loads[-1], "masters_load_s": masters_loads[-1],
                              "disk": disks[-1]}),
                  file=sys.stderr, flush=True)
            if r + 1 < args.repeats:
                shutil.rmtree(path)
        t0 = time.perf_counter()
        ck.verify(root)
        verify_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    zeroinf.engine_of(model).close()
    opt.close()
    write_bps = statistics.median(d["write_gbps"] for d in disks) * 1e9
    read_bps = statistics.median(d["read_gbps"] for d in disks) * 1e9
    save_bps = nbytes / statistics.median(saves)
    load_bps = nbytes / statistics.median(loads)
    save_ratios = [nbytes / s / (d["write_gbps"] * 1e9) for s, d in zip(saves, disks, strict=True)]
    load_ratios = [nbytes / s / (d["read_gbps"] * 1e9) for s, d in zip(loads, disks, strict=True)]
    print(json.dumps({
        "params": nparams, "optimizer_states_on": args.optimizer, "checkpoint_bytes": nbytes, "build_s": build_s,
        "save_s": saves, "load_s": loads, "masters_load_s": masters_loads, "verify_s": verify_s,
        "masters_load_vs_load": round(statistics.median(masters_loads) / statistics.median(loads), 3),
        "save_bytes_per_s": round(save_bps), "load_bytes_per_s": round(load_bps),
        "disk_write_bytes_per_s": round(write_bps), "disk_read_bytes_per_s": round(read_bps),
        "save_vs_disk_write": round(save_bps / write_bps, 3), "load_vs_disk_read": round(load_bps / read_bps, 3),
        "save_vs_disk_write_per_round": [round(x, 3) for x in save_ratios],
        "load_vs_disk_read_per_round": [round(x, 3) for x in load_ratios],
        "disk_per_round": disks, "peak_rss_bytes": peak_rss_bytes(), "machine": machine(),
    }, indent=1))
    if args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
