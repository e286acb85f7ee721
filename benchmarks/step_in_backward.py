"""The optimizer step inside backward against the step after it, side by side in one process.

    python benchmarks/step_in_backward.py --nvme-dir /tmp/zi-sib [--preset 125m] [--steps 4]

Stage 3, world 1, fp32, parameters, gradients and optimizer states on NVMe (the fully offloaded
placement). Variants, built and stepped in turn (round-robin, so drift of the machine hits all):
- `after`: `offload.step_in_backward = false`, no clipping;
- `in`: stepped inside backward, no clipping ("final");
- `in-clip-idle`: clipping that never triggers: speculative, confirmed every step;
- `in-clip-undo`: clipping that triggers every step, and the hold-back after a clipped step turned
  off, so every step is speculated, undone and redone: the cost of one undo;
- `after-clip`: clipping that triggers, stepped after backward (what `in-clip-undo` is measured against).
Per variant: median seconds per step (first step dropped), NVMe bytes per parameter per step by kind
(the engine's counters), disk-busy share, and whether every variant's weights equal its reference's
(`in` == `after`, `in-clip-*` == the after-backward step with the same clipping) bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _bench import add_offload_args, build, close, machine, median, train_step  # noqa: E402

import zeroinf  # noqa: E402
from zeroinf.models.gpt import GPTConfig  # noqa: E402

VARIANTS = {  # name: (step_in_backward, grad_clip_norm, speculate every step)
    "after": (False, None, False),
    "in": (True, None, False),
    "in-clip-idle": (True, 1e9, False),
    "after-clip": (False, 1e-3, False),
    "in-clip-undo": (True, 1e-3, True),
}
REFERENCE = {"in": "after", "in-clip-idle": "after", "in-clip-undo": "after-clip"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_offload_args(parser, preset="125m", seq_len=64)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    gpt = GPTConfig.preset(a.preset, seq_len=a.seq_len)
    runs = {}
    for name, (on, clip, _) in VARIANTS.items():
        folder = os.path.join(a.nvme_dir, name)
        os.makedirs(folder, exist_ok=True)
        offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=folder,
                                        step_in_backward=on)
        cfg = zeroinf.Config(stage=3, param_dtype="fp32", grad_clip_norm=clip, offload=offload)
        runs[name] = build(gpt, cfg, a.batch)
    seconds: dict[str, list[float]] = {n: [] for n in runs}
    io: dict[str, list[dict]] = {n: [] for n in runs}
    for step in range(a.steps):
        for name, run in runs.items():
            if VARIANTS[name][2]:
                run.opt._hold_back = False  # measure the undo on every step, not only the first
            s, _ = train_step(run, step)
            seconds[name].append(s)
            io[name].append(zeroinf.memory_report(run.model)["io"]["last_step"])
    params = sum(u.layout.numel for u in zeroinf.engine_of(runs["after"].model).all_units)
    weights = {n: {k: v.clone() for k, v in r.model.state_dict().items()} for n, r in runs.items()}
    rollbacks = {n: r.opt.rollbacks for n, r in runs.items()}
    for run in runs.values():
        close(run)
    out = {
        "machine": machine(),
        "args": vars(a),
        "params": params,
        "variants": {
            name: {
                "median_step_s": median(seconds[name][1:]),
                "step_s": seconds[name],
                "bytes_per_param": io[name][-1]["bytes_per_param"],
                "by_kind_per_param": {
                    k: {d: v / params for d, v in b.items()} for k, b in io[name][-1]["by_kind"].items()
                },
                "disk_busy_share": io[name][-1]["disk_busy_share"],
                "rollbacks": rollbacks[name],
            }
            for name in runs
        },
        "bitwise_equal_to_reference": {
            name: all(torch.equal(weights[name][k], weights[ref][k]) for k in weights[ref])
            for name, ref in REFERENCE.items()
        },
    }
    base = out["variants"]["after"]["median_step_s"]
    out["ratio_in_over_after"] = out["variants"]["in"]["median_step_s"] / base
    variants = out["variants"]
    out["undo_cost_s"] = variants["in-clip-undo"]["median_step_s"] - variants["after-clip"]["median_step_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
