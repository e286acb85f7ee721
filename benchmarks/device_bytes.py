"""Engine memory per parameter with everything on the device, measured and predicted.

    python benchmarks/device_bytes.py [--steps 3] [--stage 3]

Measured: a small Hugging Face Llama (29M parameters) trains `--steps` steps at stage 3, world 1,
parameters, gradients and optimizer on the device (the CPU here), with activation checkpointing, in
fp32 and in bf16, prefetching two blocks ahead; the engine's ledger gives its device bytes per
parameter, live after the step and at the step's peak, by tag. torch.optim's AdamW on fp32
parameters (and FSDP2) holds 12 live and 16 with the gradients (optim/states.py [Note: masters in
the memory shard]; the step inside backward frees each gradient once its unit is stepped).
`--stage 0|1|2` measures those stages instead (world 1: the whole model is each rank's).
Predicted: the planner's ledger bytes (the same tags, no activations) for the GPU issue's 3.4B
Llama (hidden 3200, 26 layers, intermediate 8640, vocab 32000), bf16, one CUDA device, the case
where FSDP2 peaked at 53.1 GiB. No GPU is needed for either figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import machine  # noqa: E402


def _llama(hidden: int, layers: int, ffn: int, heads: int, vocab: int, seq: int, meta: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _config(dtype: str, prefetch_bytes: int | None = None, stage: int = 3) -> object:
    import zeroinf

    offload = zeroinf.OffloadConfig(params="device", optimizer="device", gradients="device")
    extra = {} if prefetch_bytes is None else {"prefetch_bytes": prefetch_bytes}
    return zeroinf.Config(stage=stage, param_dtype=dtype, activation_checkpointing=True, offload=offload, **extra)


def measured(dtype: str, steps: int, stage: int = 3) -> dict:
    import zeroinf

    model = _llama(512, 8, 1376, 8, 4000, 256)
    n = sum(p.numel() for p in model.parameters())
    # Prefetch two blocks ahead (a block is 12.6 MB in fp32): the default budget would keep this small
    # model gathered whole, which a model of the sizes that matter never is.
    model = zeroinf.shard(model, _config(dtype, prefetch_bytes=32 * 2**20, stage=stage))
    opt = zeroinf.AdamW(model, lr=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 4000, (2, 128), generator=g)
        loss = model(input_ids=x, labels=x).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    report = zeroinf.memory_report(model)
    out = {
        "params": n,
        "live_bytes_per_param": report["device"]["live_bytes"] / n,
        "step_peak_bytes_per_param": report["last_step"]["device"]["peak_bytes"] / n,
        "live_by_tag": {k: v for k, v in report["device"]["by_tag"].items() if v},
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def predicted_3b() -> dict:
    from zeroinf.partition.wrap import discover_units
    from zeroinf.planner.estimate import ledger_bytes
    from zeroinf.planner.unit_plan import UnitShape, plan_units

    model = _llama(3200, 26, 8640, 32, 32000, 2048, meta=True)
    n = sum(p.numel() for p in model.parameters())
    cfg: Any = _config("bf16")  # the units the engine builds under it (the embedding and head split)
    specs = discover_units(model, (), split_min_numel=cfg.split_min_numel, split_any_size=cfg.split_any_size)
    tiers = ledger_bytes(plan_units([UnitShape.of(spec) for spec in specs], cfg, 1, "cuda"))
    return {
        "params": n, "device_gib": tiers.device / 2**30, "device_bytes_per_param": tiers.device / n,
        "by_tag_gib": {k: round(v / 2**30, 2) for k, v in tiers.by_tag["device"].items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    a = p.parse_args()
    result = {"machine": machine(), "stage": a.stage,
              "measured": {d: measured(d, a.steps, a.stage) for d in ("fp32", "bf16")},
              "predicted_3.4b_bf16_cuda": predicted_3b()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
