"""Memory and time of a Hugging Face Llama at stage 3 with its embedding and head split from the
root unit (`Config.split_root`, the default) or kept in it.

    python benchmarks/root_split.py --nvme-dir /tmp/zi-split [--layers 8 --hidden 1024 --vocab 32000]
        [--params nvme --optimizer host] [--dtype bf16] [--steps 4] [--rounds 2]

Each variant runs in a fresh process (its peak RSS is the process's high-water mark), alternately
for `--rounds` rounds: build the Llama from its config under `zeroinf.init`, shard it (parameters
and optimizer states where asked), train `--steps` steps of `--batch` x `--seq-len` random tokens.
Prints JSON: per variant and round, RSS before the build, peak RSS above it (build, and steps),
what the built model keeps, the engine's unsharded parameter bytes at rest (between steps), the
last step's peak on the engine's device ledger (gathered parameters and gradient buffers: a GPU's
memory), median seconds per step (the first dropped), the losses (equal across variants: the same
math), and the units. On a CPU machine the device and the host are the same RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import machine, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402


def child(a: argparse.Namespace, split: bool) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    import zeroinf

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = max(1, a.hidden // 64)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate or int(2.75 * a.hidden),
        num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=a.seq_len, tie_word_embeddings=False,
    )
    folder = os.path.join(a.nvme_dir, f"split-{split}")
    os.makedirs(folder, exist_ok=True)
    offload = zeroinf.OffloadConfig(params=a.params, optimizer=a.optimizer, nvme_dir=folder)
    cfg = zeroinf.Config(stage=3, param_dtype=a.dtype, split_root=split, offload=offload)
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    with zeroinf.init(cfg):
        model = LlamaForCausalLM(config)
    model = zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=1e-4)
    build_s = time.perf_counter() - t0
    build_peak = peak_rss_bytes() - before
    kept = rss_bytes() - before
    engine = zeroinf.engine_of(model)
    g = torch.Generator().manual_seed(1)
    losses, seconds, unsharded_at_rest = [], [], []
    for _ in range(a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t)
        losses.append(loss.item())
        unsharded_at_rest.append(sum(u.unsharded_bytes for u in engine.all_units if u.state.value != "sharded"))
    report = zeroinf.memory_report(model)
    out = {
        "split_root": split,
        "units": [u.name for u in engine.all_units if u.name and not u.name.startswith("model.layers.")],
        "root_bytes": sum(u.unsharded_bytes for u in engine.all_units if u.name == "<root>"),
        "build_s": build_s, "build_peak_above_bytes": build_peak, "kept_after_build_bytes": kept,
        "peak_above_bytes": peak_rss_bytes() - before,
        "unsharded_param_bytes_at_rest": unsharded_at_rest[-1],
        # the engine's device ledger over the last step (parameters gathered, gradient buffers): on a GPU
        # this is the accelerator's memory; here the same RAM as the rest
        "ledger_device_step_peak_bytes": report["last_step"]["device"]["peak_bytes"],
        "ledger_device_step_peak_by_tag": report["last_step"]["device"]["by_tag"],
        "median_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
        "step_s": seconds, "losses": losses,
    }
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=0, help="0: 2.75 x hidden")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--params", default="nvme", choices=["device", "host", "nvme"])
    ap.add_argument("--optimizer", default="host", choices=["device", "host", "nvme"])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a, a.child == "true")))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"true": [], "false": []}
    for _ in range(a.rounds):
        for split in ("true", "false"):
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", split]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[split].append(json.loads(done.stdout.strip().splitlines()[-1]))
    on, off = runs["true"], runs["false"]

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out = {
        "machine": machine(), "command": " ".join(["benchmarks/root_split.py", *(argv or sys.argv[1:])]),
        "runs": runs,
        "same_losses": all(r["losses"] == off[0]["losses"] for r in on + off),
        "peak_above_split_over_root": med(on, "peak_above_bytes") / med(off, "peak_above_bytes"),
        "step_s_split_over_root": med(on, "median_step_s") / med(off, "median_step_s"),
        "device_step_peak_split_over_root": med(on, "ledger_device_step_peak_bytes")
        / med(off, "ledger_device_step_peak_bytes"),
        "unsharded_at_rest_bytes": {"split": med(on, "unsharded_param_bytes_at_rest"),
                                    "root": med(off, "unsharded_param_bytes_at_rest")},
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
