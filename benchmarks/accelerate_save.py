"""accelerate's `save_state` / `load_state` of a sharded model: the whole state on rank 0 against
`zeroinf.integrations.sharded_save_state`, side by side.

    torchrun --nproc-per-node 2 benchmarks/accelerate_save.py --dir /tmp/zi-acc [--preset 125m] [--repeats 3]

The demo GPT at stage 3 (bf16 parameters, AdamW with fp32 masters and moments on `--tier`), one step,
then per repeat and per way, alternately: `save_state` into a fresh folder, then `load_state` of it.
"whole" is accelerate's own path, which gets the whole state in torch.optim's format gathered on rank
0 (integrations/accelerate_loop.py [Note: accelerate's save_state of sharded states]); "sharded"
registers `sharded_save_state`, and each rank writes its own piece with zeroinf.save. Prints JSON
from rank 0: median seconds of save and load per way, each rank's largest RSS growth during a save
(VmHWM over the RSS before it, the peak reset first where the kernel allows; the first save's, as the
heap keeps what a save took for the next), the optimizer file's bytes,
and the folder's bytes; and whether a load restores the saved states bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _bench import machine, median, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

import zeroinf  # noqa: E402
from zeroinf.models.gpt import GPT, GPTConfig  # noqa: E402


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> int:
    from accelerate import Accelerator

    from zeroinf.integrations import sharded_save_state

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--tier", default="host", choices=["device", "host", "nvme"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    topo = zeroinf.init_distributed()
    nvme = os.path.join(a.dir, f"swap{topo.rank}")
    os.makedirs(nvme, exist_ok=True)
    cfg = zeroinf.Config(stage=3, param_dtype="bf16", offload=zeroinf.OffloadConfig(
        params=a.tier, optimizer=a.tier, nvme_dir=nvme if a.tier == "nvme" else None))
    gpt = GPTConfig.preset(a.preset)
    ways: dict[str, dict] = {}
    for way in ("whole", "sharded"):
        torch.manual_seed(0)
        with zeroinf.init(cfg):
            model = GPT(gpt)
        model = zeroinf.shard(model, cfg)
        accelerator = Accelerator(cpu=True)
        opt = zeroinf.AdamW(model, lr=1e-4)
        model, opt = accelerator.prepare(model, opt)
        if way == "sharded":
            sharded_save_state(accelerator)
        x = torch.randint(0, gpt.vocab_size, (2, 64), generator=torch.Generator().manual_seed(topo.rank))
        loss = model(x, x)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        ways[way] = {"accelerator": accelerator, "model": model, "opt": opt}
    params = sum(u.layout.numel for u in zeroinf.engine_of(ways["whole"]["model"]).all_units)
    runs: dict[str, dict[str, list]] = {w: {"save_s": [], "load_s": [], "save_rss_growth": []} for w in ways}
    sizes: dict[str, dict[str, int]] = {}
    exact: dict[str, bool] = {}
    for repeat in range(a.repeats):
        for way, held in ways.items():
            path = os.path.join(a.dir, f"{way}-{repeat}")
            before = zeroinf.optimizer_state(held["opt"])
            dist.barrier()
            reset_peak_rss()
            base = rss_bytes()
            t0 = time.perf_counter()
            held["accelerator"].save_state(path)
            dist.barrier()
            runs[way]["save_s"].append(time.perf_counter() - t0)
            growth = torch.tensor([peak_rss_bytes() - base], dtype=torch.int64)
            grown = [torch.zeros_like(growth) for _ in range(topo.world_size)]
            dist.all_gather(grown, growth)
            runs[way]["save_rss_growth"].append([int(g) for g in grown])
            sizes[way] = {"optimizer_file": os.path.getsize(os.path.join(path, "optimizer.bin")),
                          "folder": folder_bytes(path)}
            t0 = time.perf_counter()
            held["accelerator"].load_state(path)
            dist.barrier()
            runs[way]["load_s"].append(time.perf_counter() - t0)
            after = zeroinf.optimizer_state(held["opt"])
            exact[way] = all(torch.equal(before[p][k], after[p][k]) for p in before for k in before[p])
            if topo.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    if topo.rank == 0:
        out = {
            "machine": machine(), "world": topo.world_size, "preset": a.preset, "params": params, "tier": a.tier,
            "repeats": a.repeats,
            "ways": {
                w: {"save_s": median(r["save_s"]), "load_s": median(r["load_s"]),
                    # the largest over the repeats: the first save's growth (the heap then keeps what it took)
                    "save_rss_growth_bytes_by_rank": [max(g[k] for g in r["save_rss_growth"])
                                                      for k in range(topo.world_size)],
                    **sizes[w], "restores_bitwise": exact[w]}
                for w, r in runs.items()
            },
        }
        print(json.dumps(out, indent=1))
    for held in ways.values():
        held["opt"].close()
        zeroinf.engine_of(held["model"]).close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
