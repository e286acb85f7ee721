"""Host memory and time to build a ~1.1B-parameter Hugging Face Llama, `zeroinf.init(cfg)` vs eager.

Each variant runs in a fresh process (its peak RSS is the kernel's high-water mark, reset after
the imports and a small warm-up build) and builds the model, then `zeroinf.shard`s it at stage 3
with parameters on NVMe:
- eager: `LlamaForCausalLM(config)` on the CPU (the whole fp32 model exists), then shard;
- init:  the same under `with zeroinf.init(cfg)`: parameters parked on NVMe as their modules are
  attached (the embedding and head blank, as soon as registered, their initializations drawn into
  the park piece by piece), `post_init` touching them through the park, then shard unit by unit;
- init_exact: `zeroinf.init(cfg, exact_masters=True)`: slices parked in fp32 (twice the park on
  NVMe) and, past `shard`, the fp32 values the optimizer's masters start from kept in the park
  (`kept_bytes`), so that a bf16 model trains as if built eagerly.
Prints JSON: per variant, RSS before, peak RSS above it (construction and shard separately),
seconds, the park's counters and NVMe bytes; and the sizes to compare with: one decoder layer
(a unit) and the root unit (embeddings + head, kept unsharded on the device at stage 3).

    python benchmarks/init_memory.py --nvme-dir /tmp/zi-init [--layers 22 --hidden 2048] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402


def llama_config(layers: int, hidden: int, intermediate: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    heads = max(1, hidden // 64)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 8), max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def sizes(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, int]:
    heads = max(1, hidden // 64)
    kv = max(1, heads // 8) * 64
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden
    root = 2 * vocab * hidden + hidden
    return {"layer_params": layer, "root_params": root, "params": layers * layer + root}


def build_once(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import zeroinf

    hf_logging.set_verbosity_error()
    folder = os.path.join(args.nvme_dir, variant)
    os.makedirs(folder, exist_ok=True)
    cfg = zeroinf.Config(
        stage=3, param_dtype=args.dtype, persist_threshold_bytes=0,
        offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=folder),
    )
    warm_folder = os.path.join(folder, "warm")
    os.makedirs(warm_folder, exist_ok=True)
    warm_cfg = zeroinf.Config(stage=3, param_dtype=args.dtype, persist_threshold_bytes=0,
                              offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=warm_folder))
    with zeroinf.init(warm_cfg):  # first-use costs (imports, kernels) are not the model's
        warm = LlamaForCausalLM(llama_config(2, 128, 256, 256))
    zeroinf.shard(warm, warm_cfg)
    zeroinf.engine_of(warm).close()
    del warm
    config = llama_config(args.layers, args.hidden, args.intermediate, args.vocab)
    torch.manual_seed(0)
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    park = None
    if variant in ("init", "init_exact"):
        with zeroinf.init(cfg, exact_masters=variant == "init_exact") as park:
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    construct_s = time.perf_counter() - t0
    construct_peak = peak_rss_bytes() - before
    reset_peak_rss()
    t1 = time.perf_counter()
    zeroinf.shard(model, cfg)
    shard_s = time.perf_counter() - t1
    out = {
        "variant": variant, "rss_before_bytes": before,
        "construct_s": construct_s, "shard_s": shard_s, "build_s": construct_s + shard_s,
        "construct_peak_above_bytes": construct_peak,
        "shard_peak_above_bytes": peak_rss_bytes() - before,
        "after_above_bytes": rss_bytes() - before,
        "nvme_written_bytes": zeroinf.memory_report(model)["io"]["nvme_written_bytes"],
    }
    out["peak_above_bytes"] = max(out["construct_peak_above_bytes"], out["shard_peak_above_bytes"])
    if park is not None:
        out.update(parks=park.parks, unparks=park.unparks, park_written_bytes=park.parked_bytes,
                   blank_parks=park.blanks, draws=park.draws,
                   kept_bytes=sum(
                       4 * kept.numel for unit in zeroinf.engine_of(model).units for _, kept in unit._kept_masters
                   ))
    zeroinf.engine_of(model).close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--variants", default="eager,init")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = [name for name in args.variants.split(",") if name not in ("eager", "init", "init_exact")]
    if unknown:  # anything but "init" would have been built eagerly
        ap.error(f"--variants {','.join(unknown)}: unknown; choose from eager,init,init_exact")
    args.nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zeroinf-init-", dir="/tmp")
    if args.child:
        print(json.dumps(build_once(args.child, args)))
        return 0
    runs = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--nvme-dir", args.nvme_dir, "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--intermediate", str(args.intermediate), "--vocab", str(args.vocab),
               "--dtype", args.dtype]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        runs[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    size = sizes(args.layers, args.hidden, args.intermediate, args.vocab)
    itemsize = {"fp32": 4, "bf16": 2}[args.dtype]
    out = {
        "model": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                  "vocab": args.vocab, **size, "dtype": args.dtype},
        "unit_fp32_bytes": 4 * size["layer_params"], "unit_bytes": itemsize * size["layer_params"],
        "root_unit_bytes": itemsize * size["root_params"],
        "runs": runs,
    }
    if "init" in runs:
        init = runs["init"]
        out["init_peak_above_in_units"] = init["peak_above_bytes"] / out["unit_bytes"]
        out["init_peak_above_minus_root_in_units"] = (init["peak_above_bytes"] - out["root_unit_bytes"]) / out[
            "unit_bytes"]
        if "eager" in runs:
            out["build_time_ratio_init_over_eager"] = init["build_s"] / runs["eager"]["build_s"]
            out["peak_ratio_init_over_eager"] = init["peak_above_bytes"] / runs["eager"]["peak_above_bytes"]
    if "init_exact" in runs:
        out["init_exact_peak_above_in_units"] = runs["init_exact"]["peak_above_bytes"] / out["unit_bytes"]
        if "init" in runs:
            out["build_time_ratio_exact_over_init"] = runs["init_exact"]["build_s"] / runs["init"]["build_s"]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
