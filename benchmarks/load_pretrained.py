"""Load a pretrained Llama checkpoint larger than you would like in RAM, straight into NVMe shards.

1. Writes (once) a Hugging Face folder: config.json and bf16 safetensors of random weights (N(0, 0.02))
   for a Llama shape of about `--params` parameters, tensor by tensor (never the whole model).
2. Measures this disk's O_DIRECT read speed on that checkpoint, in the same run.
3. In a fresh process: `zeroinf.from_pretrained` at world 1, stage 3, parameters on NVMe (peak RSS
   above the process's RSS before the load, from the kernel's high-water mark; load seconds), then
   `--steps` fine-tuning steps with the optimizer states on NVMe (full, or LoRA with --lora-rank).
Prints JSON. Check free disk first: checkpoint + parameter swap (+ 12 bytes per trainable parameter
of optimizer states).

    python benchmarks/load_pretrained.py --dir /tmp/zi-load --params 3e9
    python benchmarks/load_pretrained.py --dir /tmp/zi-14b --params 14e9 --dtype bf16 --lora-rank 8 --steps 1
    python benchmarks/load_pretrained.py --dir /tmp/zi-moe --arch mixtral --params 2.5e9 --dtype bf16

`--arch mixtral` writes the checkpoint in the Hub's layout (one tensor per expert and matrix, as
transformers' `save_pretrained` writes it), which transformers 5 fuses into one 3-D parameter per
layer at load (weights/hf_conversion.py): the JSON then also gives one layer's experts in bytes
(what reading them whole and fusing them would hold at once) beside the load's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

VOCAB = 32000
SHAPES = [(1.5e9, 2048, 5632, 16), (4.5e9, 3200, 8640, 32), (9e9, 4096, 11008, 32), (float("inf"), 5120, 13824, 40)]



def llama_config(params: float) -> Any:
    from transformers import LlamaConfig

    _, hidden, inter, heads = next(s for s in SHAPES if params <= s[0])
    layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * VOCAB * hidden) / layer))
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, dtype="bfloat16", tie_word_embeddings=False,
    )


MIXTRAL_EXPERTS, MIXTRAL_HIDDEN, MIXTRAL_INTER = 8, 1024, 3584


def mixtral_config(params: float) -> Any:
    from transformers import MixtralConfig

    hidden, inter = MIXTRAL_HIDDEN, MIXTRAL_INTER
    layer = 2 * hidden * hidden + 2 * hidden * hidden // 4 + MIXTRAL_EXPERTS * (3 * hidden * inter + hidden)
    layers = max(1, round((params - 2 * VOCAB * hidden) / layer))
    return MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, num_local_experts=MIXTRAL_EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=None, dtype="bfloat16",
        tie_word_embeddings=False,
    )


def write_checkpoint(folder: str, params: float, arch: str = "llama") -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from zeroinf.weights.export import write_safetensors_files

    config = mixtral_config(params) if arch == "mixtral" else llama_config(params)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    # the Hub's layout: what transformers' save_pretrained writes (its conversions reverted)
    stored = revert_weight_conversion(meta, dict(meta.state_dict()))
    entries = [(n, tuple(t.shape), torch.bfloat16) for n, t in stored.items()]
    t0 = time.perf_counter()
    generator = torch.Generator().manual_seed(0)

    def produce(i: int) -> torch.Tensor:
        name, shape, dtype = entries[i]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        return (torch.randn(shape, generator=generator) * 0.02).to(dtype)

    write_safetensors_files(folder, entries, produce, max_shard_bytes=4 * 10**9)
    config.save_pretrained(folder)
    return {"write_s": time.perf_counter() - t0, "params": sum(int(torch.Size(s).numel()) for _, s, _ in entries)}


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def disk_read_speed(folder: str, limit_bytes: int = 2 * 2**30) -> float:
    """Bytes/s of O_DIRECT reads of the checkpoint files through the aio engine (1 GiB requests)."""
    from zeroinf.aio import AioConfig, AioEngine, aligned_empty

    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    chunk = aligned_empty(2**30)
    done, t0 = 0, time.perf_counter()
    with AioEngine(AioConfig()) as engine:
        for path in files:
            size = os.path.getsize(path) // 4096 * 4096
            for offset in range(0, size, chunk.numel()):
                n = min(chunk.numel(), size - offset, limit_bytes - done)
                if n <= 0:
                    break
                engine.read(chunk[:n], path, offset).wait()
                done += n
    return done / (time.perf_counter() - t0)


def disk_write_speed(folder: str, nbytes: int = 2 * 2**30) -> float:
    """Bytes/s of O_DIRECT writes into `folder` through the aio engine (1 GiB requests); file removed."""
    from zeroinf.aio import AioConfig, AioEngine, aligned_empty

    chunk = aligned_empty(2**30)
    chunk.fill_(1)
    path = os.path.join(folder, "write-speed.bin")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    with AioEngine(AioConfig()) as engine:
        for offset in range(0, nbytes, chunk.numel()):
            engine.write(chunk, path, offset).wait()
    speed = nbytes / (time.perf_counter() - t0)
    os.remove(path)
    return speed


def child(args: argparse.Namespace) -> dict[str, Any]:
    import zeroinf

    swap = os.path.join(args.dir, "swap")
    shutil.rmtree(swap, ignore_errors=True)
    os.makedirs(swap)
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=swap)
    cfg = zeroinf.Config(stage=3, param_dtype=args.dtype, persist_threshold_bytes=0, offload=offload,
                         activation_checkpointing=True)
    prepare = None
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, target_modules="all-linear", lora_dropout=0.0)
        prepare = lambda m: get_peft_model(m, lora)  # noqa: E731
    import transformers

    # Imported before the baseline: importing the library and its model module (seconds, and their own
    # RSS) is not the load's cost, and a user's process has done it once for every model it loads.
    transformers.LlamaForCausalLM, transformers.MixtralForCausalLM  # noqa: B018  (imported lazily)

    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    model = zeroinf.from_pretrained(os.path.join(args.dir, "model"), cfg, prepare=prepare)
    load_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "rss_before_bytes": before, "load_s": load_s, "load_peak_above_bytes": peak_rss_bytes() - before,
        "after_load_above_bytes": rss_bytes() - before,
        "load_written_bytes": zeroinf.memory_report(model)["io"]["nvme_written_bytes"],
    }
    model.train()
    t1 = time.perf_counter()
    opt = zeroinf.AdamW(model, lr=1e-5)
    out["optimizer_build_s"] = time.perf_counter() - t1
    ids = torch.randint(0, VOCAB, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    out["step_s"], out["losses"] = [], []
    for _ in range(args.steps):
        t2 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        out["step_s"].append(time.perf_counter() - t2)
        out["losses"].append(loss.item())
    out["peak_rss_above_bytes"] = peak_rss_bytes() - before
    report = zeroinf.memory_report(model)
    out["io"] = report["io"]
    out["nvme_bytes"] = report["nvme"]["live_bytes"]
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def child_transformers(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' own `from_pretrained` of the same folder, in the run's dtype (`--compare-hf`)."""
    import transformers

    transformers.LlamaForCausalLM, transformers.MixtralForCausalLM  # noqa: B018  (imported lazily)
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    transformers.AutoModelForCausalLM.from_pretrained(os.path.join(args.dir, "model"), dtype=dtype)
    return {"load_s": time.perf_counter() - t0, "load_peak_above_bytes": peak_rss_bytes() - before}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="holds the checkpoint (model/) and the swap files (swap/)")
    ap.add_argument("--params", type=float, default=3e9)
    ap.add_argument("--arch", default="llama", choices=["llama", "mixtral"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype of the run")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--compare-hf", action="store_true", help="also time transformers' own from_pretrained")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-hf", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child or args.child_hf:
        print("RESULT " + json.dumps(child_transformers(args) if args.child_hf else child(args)))
        return 0
    model_dir = os.path.join(args.dir, "model")
    out: dict[str, Any] = {"free_disk_bytes_before": shutil.disk_usage(args.dir if os.path.exists(args.dir) else
                                                                       os.path.dirname(args.dir)).free}
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        out["write"] = write_checkpoint(model_dir, args.params, args.arch)
    out["checkpoint_bytes"] = checkpoint_bytes(model_dir)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    out["model"] = {k: cfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "vocab_size") if k in cfg}
    if "num_local_experts" in cfg:  # one layer's experts, bf16: what a whole-tensor fusion holds at once
        out["model"]["layer_experts_bytes"] = cfg["num_local_experts"] * 3 * cfg["hidden_size"] * cfg[
            "intermediate_size"] * 2
    out["disk_read_bytes_per_s"] = disk_read_speed(model_dir)
    out["disk_write_bytes_per_s"] = disk_write_speed(os.path.join(args.dir, "swap"))
    cmd = [sys.executable, __file__, "--child", "--dir", args.dir, "--params", str(args.params), "--dtype",
           args.dtype, "--lora-rank", str(args.lora_rank), "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        print(done.stderr[-4000:], file=sys.stderr)
        return done.returncode
    run = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    out["run"] = run
    out["load_read_bytes_per_s"] = out["checkpoint_bytes"] / run["load_s"]
    out["load_speed_vs_disk_read"] = out["load_read_bytes_per_s"] / out["disk_read_bytes_per_s"]
    # The load reads the checkpoint and writes the parameter swap file on the same disk: the time the
    # disk alone needs for both, at the speeds measured above, over the load's time.
    disk_s = out["checkpoint_bytes"] / out["disk_read_bytes_per_s"] + run["load_written_bytes"] / out[
        "disk_write_bytes_per_s"]
    out["load_speed_vs_disk_read_and_write"] = disk_s / run["load_s"]
    if args.compare_hf:
        done = subprocess.run([*cmd[:2], "--child-hf", *cmd[3:]], capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        out["transformers"] = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    out["cpu"] = open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
