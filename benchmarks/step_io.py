"""Bytes moved per parameter per step, fully NVMe-offloaded, from the engine's own counters, checked
against the kernel's (`/proc/self/io`), with the disk-busy share of each step.

    python benchmarks/step_io.py --nvme-dir /tmp/zi-io [--preset 125m] [--seq-len 64] [--steps 3] [--param-cache 2GiB]
        [--moment-dtype bf16]   # Adam's moments in bf16: 4 bytes per parameter fewer each way

Stage 3, world 1, fp32 (the issue's setting; `--dtype bf16` computes in bf16 with fp32 masters, for a
CPU with bf16 hardware), parameters, gradients and optimizer states on NVMe.
Prints one JSON object: per step `memory_report()["io"]["last_step"]` (bytes per kind, bytes per
parameter, disk-busy share) beside the /proc/self/io read_bytes/write_bytes deltas of the same
window (what reached the block layer: O_DIRECT transfers, plus anything else the process did), and
the step's minor page faults (memory mapped afresh: buffers above glibc's 32 MiB mmap ceiling).
`--grad-pool off` allocates every gradient buffer afresh (partition/grad_pool.py), to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _bench import (  # noqa: E402
    add_offload_args,
    add_step_memory_args,
    apply_grad_pool,
    build,
    close,
    machine,
    reuse_step_memory,
    train_step,
)

import zeroinf  # noqa: E402
from zeroinf.models.gpt import GPTConfig  # noqa: E402


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_offload_args(parser, preset="125m", seq_len=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--param-cache", default="0", help="offload.param_cache_bytes, e.g. 2GiB (0: none)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="param_dtype (compute)")
    parser.add_argument("--moment-dtype", default="fp32", choices=["fp32", "bf16"], help="offload.moment_dtype")
    add_step_memory_args(parser)
    a = parser.parse_args()
    os.makedirs(a.nvme_dir, exist_ok=True)
    gpt = GPTConfig.preset(a.preset, seq_len=a.seq_len)
    offload = zeroinf.OffloadConfig(
        params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=a.nvme_dir, param_cache_bytes=a.param_cache,
        moment_dtype=a.moment_dtype)
    cfg = zeroinf.Config(stage=3, param_dtype=a.dtype, reuse_step_memory=reuse_step_memory(a), offload=offload)
    run = build(gpt, cfg, a.batch)
    apply_grad_pool(run, a)
    steps = []
    for step in range(a.steps):
        before, faults = proc_io(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds, loss = train_step(run, step)
        after, faults = proc_io(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        last = zeroinf.memory_report(run.model)["io"]["last_step"]
        kernel = {k: after[k] - before[k] for k in ("read_bytes", "write_bytes")}
        engine_bytes = last["read_bytes"] + last["written_bytes"]
        steps.append({
            "step_s": seconds, "loss": loss, "engine": last, "proc_self_io": kernel,
            "engine_over_kernel": engine_bytes / max(1, kernel["read_bytes"] + kernel["write_bytes"]),
            # pages touched for the first time in the step (freshly mapped buffers): each costs a fault
            "minor_faults": faults, "fresh_page_bytes": faults * resource.getpagesize(),
        })
    params = sum(u.layout.numel for u in zeroinf.engine_of(run.model).all_units)
    close(run)
    print(json.dumps({"machine": machine(), "args": vars(a), "params": params, "steps": steps},
                     indent=1))


if __name__ == "__main__":
    main()
