"""`zeroinf.ema_update` at stage 3: averaged shard to shard against the gathered path, side by side.

    python benchmarks/ema_update.py --nvme-dir /tmp/zi-ema [--preset 125m] [--tier nvme] [--repeats 5]
    torchrun --nproc-per-node 2 benchmarks/ema_update.py --nvme-dir /tmp/zi-ema   # world 2 (gloo on the CPU)

The demo GPT sharded at stage 3 in `--dtype` (bf16 by default) with its parameters on `--tier`, and
two fp32 EMA models sharded alike, loaded with the model's weights. Each repeat times one
`ema_update` per path, alternately: `shard` (this rank's shards averaged in place: ema.py [Note: an
EMA averaged shard to shard]) and `gathered` (every unit of both models gathered, as before that
path existed; selected by turning the shard-to-shard pairing off). Prints JSON from rank 0: median
seconds per update and per path, their ratio, all-gathers per update, and whether the two EMAs are
bitwise equal after all repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _bench import machine, median  # noqa: E402

import zeroinf  # noqa: E402
import zeroinf.ema as ema_module  # noqa: E402
from zeroinf.models.gpt import GPT, GPTConfig  # noqa: E402


def sharded(gpt: GPTConfig, cfg: zeroinf.Config, frozen: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with zeroinf.init(cfg):
        model = GPT(gpt)
    if frozen:
        model.requires_grad_(False)
    return zeroinf.shard(model, cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", required=True)
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--tier", default="nvme", choices=["device", "host", "nvme"])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    topo = zeroinf.init_distributed()
    folder = os.path.join(a.nvme_dir, f"rank{topo.rank}")

    def cfg(dtype: str, name: str) -> zeroinf.Config:
        path = os.path.join(folder, name)
        os.makedirs(path, exist_ok=True)
        offload = zeroinf.OffloadConfig(params=a.tier, nvme_dir=path if a.tier == "nvme" else None)
        return zeroinf.Config(stage=3, param_dtype=dtype, offload=offload)

    gpt = GPTConfig.preset(a.preset)
    model = sharded(gpt, cfg(a.dtype, "model"), frozen=False)
    emas = {path: sharded(gpt, cfg("fp32", f"ema-{path}"), frozen=True) for path in ("shard", "gathered")}
    state = model.state_dict()
    for ema in emas.values():
        ema.load_state_dict(state)
    del state
    counters = [zeroinf.engine_of(m).counter for m in (model, *emas.values())]
    pairing = ema_module._shard_to_shard
    seconds: dict[str, list[float]] = {path: [] for path in emas}
    gathers: dict[str, list[int]] = {path: [] for path in emas}
    for _ in range(a.repeats):
        for path, ema in emas.items():
            ema_module._shard_to_shard = pairing if path == "shard" else (lambda e, m: [])  # type: ignore[assignment]
            before = sum(c.total["all_gather"] for c in counters)
            if topo.is_distributed:
                torch.distributed.barrier()
            t0 = time.perf_counter()
            zeroinf.ema_update(ema, model, decay=0.999)
            seconds[path].append(time.perf_counter() - t0)
            gathers[path].append(sum(c.total["all_gather"] for c in counters) - before)
    ema_module._shard_to_shard = pairing
    a_state, b_state = (ema.state_dict() for ema in emas.values())
    equal = a_state.keys() == b_state.keys() and all(torch.equal(a_state[k], b_state[k]) for k in a_state)
    params = sum(p.ds_numel if p.numel() == 0 else p.numel() for p in model.parameters())
    out = {
        "machine": machine(), "preset": a.preset, "params": params, "world": topo.world_size,
        "tier": a.tier, "model_dtype": a.dtype, "ema_dtype": "fp32", "repeats": a.repeats,
        "seconds": {path: median(s) for path, s in seconds.items()},
        "all_gathers_per_update": {path: median([float(g) for g in gs]) for path, gs in gathers.items()},
        "gathered_over_shard": median(seconds["gathered"]) / median(seconds["shard"]),
        "bitwise_equal": equal,
    }
    for m in (model, *emas.values()):
        zeroinf.engine_of(m).close()
    if topo.rank == 0:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
