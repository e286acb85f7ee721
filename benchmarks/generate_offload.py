"""Greedy decoding of a Llama whose parameters live on NVMe: prefetched along the inference trace vs on demand.

Two stage-3 models with identical weights (built under `zeroinf.init` from the same seed), parameters
on NVMe, one with the default `prefetch_bytes` (the next units are read and gathered while the
current one runs) and one with `prefetch_bytes=0` (each unit is fetched when its forward starts).
Rounds alternate between them; each round decodes `--new-tokens` greedily after a warm-up generation
(which records the inference trace). A third variant, `gathered`, decodes with the prefetched model
inside `zeroinf.gathered(list(model.parameters()))`: every unit gathered once for the whole
generation (where the model fits in memory), none per token. Prints JSON with tokens/s per round,
the medians, their ratios, NVMe bytes read per token, and whether all produced the same tokens.

    python benchmarks/generate_offload.py --nvme-dir /tmp/zi-gen [--layers 12 --hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import zeroinf


def build(args: argparse.Namespace, folder: str, prefetch_bytes: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.makedirs(folder, exist_ok=True)
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, prefetch_bytes=prefetch_bytes,
        offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=folder),
    )
    config = LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    with zeroinf.init(cfg):
        model = LlamaForCausalLM(config)
    zeroinf.shard(model, cfg)
    model.eval()
    return model


def generate(
    model: Any, ids: torch.Tensor, new_tokens: int, gathered: bool = False
) -> tuple[torch.Tensor, float, float]:
    before = zeroinf.memory_report(model)["io"]["nvme_read_bytes"]
    t0 = time.perf_counter()
    held = zeroinf.gathered(list(model.parameters())) if gathered else contextlib.nullcontext()
    with held, torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0
    return out, new_tokens / seconds, zeroinf.memory_report(model)["io"]["nvme_read_bytes"] - before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    root = args.nvme_dir or tempfile.mkdtemp(prefix="zeroinf-gen-", dir="/tmp")
    models = {
        "prefetched": build(args, os.path.join(root, "prefetched"), zeroinf.Config().prefetch_bytes),
        "on_demand": build(args, os.path.join(root, "on_demand"), 0),
    }
    ids = torch.randint(0, 32000, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    variants = {  # name: (model, inside one gathered block)
        "prefetched": ("prefetched", False), "on_demand": ("on_demand", False), "gathered": ("prefetched", True),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, torch.Tensor] = {}
    read_per_token: dict[str, float] = {}
    for model in models.values():
        generate(model, ids, 2)  # warm-up: records the inference trace
    for _ in range(args.rounds):
        for name, (model_name, gathered) in variants.items():
            out, rate, read = generate(models[model_name], ids, args.new_tokens, gathered)
            rates[name].append(rate)
            tokens[name] = out
            read_per_token[name] = read / args.new_tokens
    params = sum(u.layout.numel for u in zeroinf.engine_of(models["prefetched"]).all_units)
    result = {
        "params": params, "layers": args.layers, "hidden": args.hidden, "new_tokens": args.new_tokens,
        "tokens_per_s": rates, "median_tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "nvme_read_bytes_per_token": read_per_token,
        "same_tokens": all(torch.equal(tokens["prefetched"], t) for t in tokens.values()),
        "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
        "threads": torch.get_num_threads(),
    }
    med = result["median_tokens_per_s"]
    result["speedup_prefetched_over_on_demand"] = med["prefetched"] / med["on_demand"]
    result["speedup_gathered_over_prefetched"] = med["gathered"] / med["prefetched"]
    for model in models.values():
        zeroinf.engine_of(model).close()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
