"""Optimizer step time with the states on device, host and nvme (and nvme sub-group sizes).

    python benchmarks/optimizer_tiers.py --params 50e6 --dir /tmp --rounds 5
    python benchmarks/optimizer_tiers.py --params 200e6 --sub-groups 4194304 --moment-dtypes fp32,bf16
    python benchmarks/optimizer_tiers.py --params 100e6 --sub-groups 4194304 --optimizers adamw,torch-adamw,sgd

One model per setting (a stack of square Linear units, stage 0, world 1) gets a gradient once per
round from a one-token backward, then only `optimizer.step()` is timed (`step_in_backward` off, so
the whole update happens there). Settings alternate within
each round (A B C A B C ...) so that all see the same background load. The JSON printed at the end
holds every timing, the medians, the optimizer-state bytes moved per step and tier, the effective
update rate (params/s) and, for nvme, the disk throughput the step reached (read + written bytes
over the step time), the host bytes the offload held, the time of the same swaps with no update
(`io_only_median_s`) and the overlap of update and I/O: (io + update - step) / min(io, update),
with the host setting's step of the same moment dtype as the update time (1: the shorter one fully
hidden; 0: in sequence). `--moment-dtypes fp32,bf16` runs every setting with each dtype of the
optimizer's states (`offload.moment_dtype`: Adam's moments, a torch optimizer's states),
interleaved like the rest. `--optimizers` runs every setting with each optimizer: `adamw` is
zeroinf.AdamW (its fused kernel, the default), the others a torch optimizer through
zeroinf.ShardedOptimizer (`torch-adamw`: torch's fused AdamW, the same update as `adamw` through
the generic path; `sgd`: SGD with momentum 0.9; `adagrad`; `lion`: zeroinf.Lion); each entry also
gives the optimizer-state bytes per parameter the ledger holds on the setting's tier.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import zeroinf  # noqa: E402
from zeroinf.memory import Tier  # noqa: E402
from zeroinf.topology import Topology  # noqa: E402


class Stack(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width, bias=False) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


OPTIMIZERS = {
    "adamw": lambda model: zeroinf.AdamW(model, lr=1e-4),
    "torch-adamw": lambda model: zeroinf.ShardedOptimizer(torch.optim.AdamW, model.parameters(), lr=1e-4, fused=True),
    "sgd": lambda model: zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=1e-4, momentum=0.9),
    "adagrad": lambda model: zeroinf.ShardedOptimizer(torch.optim.Adagrad, model.parameters(), lr=1e-4),
    "lion": lambda model: zeroinf.ShardedOptimizer(zeroinf.Lion, model.parameters(), lr=1e-4),
}


def build(name: str, offload: zeroinf.OffloadConfig, layers: int, width: int, optimizer: str = "adamw") -> dict:
    torch.manual_seed(0)
    cfg = zeroinf.Config(stage=0, offload=offload)
    model = zeroinf.shard(Stack(layers, width), cfg, Topology.single(torch.device("cpu")))
    opt = OPTIMIZERS[optimizer](model)
    return {"name": name, "model": model, "opt": opt, "x": torch.randn(1, width), "times_s": [], "optimizer": optimizer}


def timed_step(run: dict) -> None:
    run["model"](run["x"]).backward()
    t0 = time.perf_counter()
    run["opt"].step()
    run["times_s"].append(time.perf_counter() - t0)
    run["moved"] = dict(run["opt"].states.traffic.last_step)
    run["opt"].zero_grad()
    if run["opt"].states.tier is Tier.NVME:  # the same swaps with no update: the I/O alone
        order = range(len(run["opt"].states.sub_groups))
        t0 = time.perf_counter()
        run["opt"]._pipeline.run(order, lambda staged: None)
        run.setdefault("io_only_s", []).append(time.perf_counter() - t0)
        run["opt"].states.traffic.this_step.clear()  # not part of any step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=50e6, help="approximate parameter count")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--dir", default="/tmp", help="a folder on the disk to swap to")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sub-groups", default="1048576,4194304,16777216", help="nvme sub_group_numel values"
    )
    parser.add_argument("--moment-dtypes", default="fp32", help="offload.moment_dtype values, e.g. fp32,bf16")
    parser.add_argument("--optimizers", default="adamw", help=f"any of {','.join(OPTIMIZERS)}")
    args = parser.parse_args()
    optimizers = args.optimizers.split(",")
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {','.join(OPTIMIZERS)}")
    layers = max(1, round(args.params / args.width**2))
    swap_root = Path(tempfile.mkdtemp(prefix="zeroinf-bench-opt-", dir=args.dir))
    settings = []
    for moments in args.moment_dtypes.split(","):
        suffix = "" if moments == "fp32" else f" {moments} moments"
        settings += [
            (f"device{suffix}", zeroinf.OffloadConfig(moment_dtype=moments, step_in_backward=False)),
            (f"host{suffix}", zeroinf.OffloadConfig(optimizer="host", moment_dtype=moments, step_in_backward=False)),
        ]
        for numel in (int(n) for n in args.sub_groups.split(",")):
            folder = swap_root / f"sg{numel}-{moments}"
            folder.mkdir()
            settings.append(
                (
                    f"nvme sub_group_numel={numel}{suffix}",
                    zeroinf.OffloadConfig(
                        optimizer="nvme", nvme_dir=str(folder), sub_group_numel=numel, moment_dtype=moments,
                        step_in_backward=False,
                    ),
                )
            )
    runs = [
        build(name if optimizer == "adamw" else f"{name} {optimizer}", offload, layers, args.width, optimizer)
        for name, offload in settings for optimizer in optimizers
    ]
    for run in runs:  # warm-up: first touch of every buffer and file
        timed_step(run)
        run["times_s"].clear()
        run.pop("io_only_s", None)
    for _ in range(args.rounds):
        for run in runs:
            timed_step(run)
    results: list[dict] = []
    numel = sum(p.numel() for p in runs[0]["model"].parameters())
    host_step = {}  # (moment dtype, optimizer): the host setting's median step, the update time without I/O
    for run in runs:
        moments = zeroinf.engine_of(run["model"]).cfg.offload.moment_dtype
        if run["opt"].states.tier is Tier.HOST:
            host_step[moments, run["optimizer"]] = statistics.median(run["times_s"])
    for run in runs:
        opt, ledger = run["opt"], zeroinf.engine_of(run["model"]).ledger
        median = statistics.median(run["times_s"])
        moved = run["moved"]
        entry = {
            "setting": run["name"],
            "median_step_s": round(median, 4),
            "times_s": [round(t, 4) for t in run["times_s"]],
            "params_per_s": round(numel / median),
            "state_bytes_moved_last_step": moved,
            "host_bytes": ledger.live_bytes(Tier.HOST),
            "sub_groups": len(opt.states.sub_groups),
            # in memory the "optimizer_state" tag (the master only where it is not the parameter shard),
            # on NVMe the swap files ("optimizer_master", "optimizer_exp_avg", ..., aligned)
            "optimizer_state_bytes_per_param": round(
                sum(n for tag, n in ledger.snapshot()[opt.states.tier.value]["by_tag"].items()
                    if tag == "optimizer_state" or tag.startswith("optimizer_") and opt.states.tier is Tier.NVME)
                / numel, 2
            ),
        }
        if opt.states.tier is Tier.NVME:
            entry["disk_GBps"] = round(
                (moved["nvme_read_bytes"] + moved["nvme_written_bytes"]) / median / 1e9, 3
            )
            # The update (the host setting's step) and the I/O alone, against the step doing both:
            # overlap 1 means the shorter of the two is fully hidden, 0 means they ran in sequence.
            moments = zeroinf.engine_of(run["model"]).cfg.offload.moment_dtype
            io_s, update_s = statistics.median(run["io_only_s"]), host_step[moments, run["optimizer"]]
            entry["io_only_median_s"] = round(io_s, 4)
            entry["overlap"] = round((io_s + update_s - median) / min(io_s, update_s), 2)
        results.append(entry)
        opt.close()
    print(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "params": numel,
                "threads": torch.get_num_threads(),
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
