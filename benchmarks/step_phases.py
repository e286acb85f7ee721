"""Where a zeroinf step's time goes at one placement: synchronized phases and an operator profile.

    python benchmarks/step_phases.py --preset 1b --placement opt-host --seq 2048 --batch 4 --out DIR
    python benchmarks/step_phases.py --model gpt --preset 98m --placement host --seq 128 --out DIR

The model and tokens are `vs_peers.py`'s (a Hugging Face Llama from a config, or the demo GPT), at
stage 3, world 1, bf16 on CUDA or on a CPU with bf16 hardware (else fp32). Each step is timed in
three synchronized phases (forward, backward with whatever the engine overlaps with it, optimizer
step), so the phase holding a placement's extra cost shows; one step after the warm-up runs under
`torch.profiler` (CPU, and CUDA when present). Writes `DIR/phases.json` (per-step phases, medians,
the engine's transfer and I/O counters of the last step) and `DIR/profile.txt` (operators by self
CPU time and, on CUDA, by self CUDA time); `--trace` also writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import vs_peers  # noqa: E402

import zeroinf  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=["llama", "gpt"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--placement", default="opt-host", choices=vs_peers.PLACEMENTS)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nvme-dir", default="/tmp/zeroinf-phases")
    p.add_argument("--out", required=True, help="folder for phases.json and profile.txt")
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace of the profiled step")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    bf16 = device.type == "cuda" or vs_peers.cpu_has_native_bf16()
    hf = a.model == "llama"
    model = vs_peers.build_model(a)
    params, optimizer, gradients = vs_peers.ZEROINF_TIERS[a.placement]
    cfg = zeroinf.Config(stage=3, param_dtype="bf16" if bf16 else "fp32", offload=zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, gradients=gradients, nvme_dir=a.nvme_dir))
    sharded = zeroinf.shard(model, cfg, zeroinf.Topology.single(device))
    opt = zeroinf.AdamW(sharded, lr=1e-4, weight_decay=0.0)
    vocab = vs_peers.vocab_of(model)

    def step(i: int) -> tuple[float, float, float, float]:
        x = vs_peers.tokens(vocab, a.batch, a.seq, i, 0, device)
        synchronize(device)
        t0 = time.perf_counter()
        loss = vs_peers.loss_of(sharded, x, hf)
        synchronize(device)
        t1 = time.perf_counter()
        opt.backward(loss)
        synchronize(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        synchronize(device)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, float(loss)

    for i in range(a.warmup):
        step(i)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled = step(a.warmup)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    if device.type == "cuda":
        table += "\n\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    with open(os.path.join(a.out, "profile.txt"), "w") as f:
        f.write(table)
    if a.trace:
        prof.export_chrome_trace(os.path.join(a.out, "trace.json"))
    timed = [step(a.warmup + 1 + i) for i in range(a.steps)]
    report = zeroinf.memory_report(sharded)
    median = {name: statistics.median(t[k] for t in timed) for k, name in enumerate(("forward", "backward", "step"))}
    out: dict[str, Any] = {
        "machine": {
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "cpu": vs_peers.cpu_name(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        },
        "args": vars(a), "dtype": cfg.param_dtype,
        "steps": [dict(forward=f, backward=b, step=s, loss=loss) for f, b, s, loss in timed],
        "profiled_step": dict(zip(("forward", "backward", "step", "loss"), profiled, strict=True)),
        "median_s": {**median, "total": sum(median.values())},
        "transfers_last_step": report["transfers"]["last_step"],
        "io": {k: v for k, v in report["io"].items() if not isinstance(v, dict)},
    }
    with open(os.path.join(a.out, "phases.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"placement": a.placement, "median_s": out["median_s"], "dtype": cfg.param_dtype}))
    zeroinf.engine_of(sharded).close()


if __name__ == "__main__":
    main()
