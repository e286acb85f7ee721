"""TRL's SFTTrainer on a Hugging Face folder: plain TRL against `zeroinf.integrations.SFTTrainer`.

Writes (once) a Llama folder of about `--params` parameters in bf16 (load_pretrained.py's writer, tensor
by tensor) with a word-level tokenizer, then, each in a fresh process, `--steps` LoRA fine-tuning steps
(rank `--lora-rank` on every linear layer) of batch 1 x `--seq-len` tokens through:
- plain `trl.SFTTrainer(model=folder)`: TRL loads the model whole with transformers;
- `zeroinf.integrations.SFTTrainer(model=folder)`: `zeroinf.from_pretrained` reads it into stage-3
  shards with the parameters on NVMe (the adapters' optimizer states on the host), with
  `Config.reuse_step_memory` "auto" (on a CPU with memory to spare the heap keeps what a step frees,
  for speed) and False ("zeroinf_lean": freed memory goes back to the OS).
Both compute in `--dtype` (TRL's `bf16=True` for plain TRL: autocast over the loaded bf16 weights).
Prints JSON: peak RSS above the process's RSS once the libraries are imported (the kernel's high-water
mark), seconds to build the trainer, seconds per step (median after the first), the losses, the CPU.

    python benchmarks/trl_sft.py --dir /tmp/zi-trl --params 1.1e9
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

from _bench import cpu_name, median, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from load_pretrained import VOCAB, write_checkpoint  # noqa: E402


def word_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = VOCAB - 2
    vocab = {f"t{i}": i for i in range(words)} | {"<pad>": words, "<eos>": words + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def child(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig

    import zeroinf
    from zeroinf.integrations import SFTTrainer

    transformers.LlamaForCausalLM  # noqa: B018  (imported lazily; importing is not the run's cost)
    folder = os.path.join(args.dir, "model")
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB - 2, (args.steps, args.seq_len - 1), generator=g).tolist()
    data = Dataset.from_dict({"text": [" ".join(f"t{i}" for i in row) for row in rows]})
    sft = trl.SFTConfig(
        output_dir=os.path.join(args.dir, "out"), per_device_train_batch_size=1, max_steps=args.steps,
        learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        use_cpu=True, bf16=args.dtype == "bf16", gradient_checkpointing=True, max_length=args.seq_len,
        model_init_kwargs={"dtype": torch.bfloat16 if args.dtype == "bf16" else torch.float32},
    )
    lora = LoraConfig(r=args.lora_rank, target_modules="all-linear", lora_dropout=0.0)
    times: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            times.append(-time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times[-1] += time.perf_counter()

    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    kwargs = dict(args=sft, train_dataset=data, processing_class=word_tokenizer(), peft_config=lora,
                  callbacks=[StepTimes()])
    if args.which == "plain":
        trainer = trl.SFTTrainer(model=folder, **kwargs)
    else:
        swap = os.path.join(args.dir, "swap")
        shutil.rmtree(swap, ignore_errors=True)
        offload = zeroinf.OffloadConfig(params="nvme", optimizer="host", nvme_dir=swap)
        cfg = zeroinf.Config(stage=3, param_dtype=args.dtype, offload=offload,
                             reuse_step_memory="auto" if args.which == "zeroinf" else False)
        kwargs["args"].model_init_kwargs = None  # the dtype is the Config's
        trainer = SFTTrainer(model=folder, zeroinf_config=cfg, **kwargs)
    build_s = time.perf_counter() - t0
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {"build_s": build_s, "step_s": times, "median_step_s": median(times[1:] or times),
            "peak_rss_above_bytes": peak_rss_bytes() - before, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="holds the model folder (model/) and the swap files (swap/)")
    ap.add_argument("--params", type=float, default=1.1e9)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--child", choices=["plain", "zeroinf", "zeroinf_lean"], dest="which", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.which:
        print("RESULT " + json.dumps(child(args)))
        return 0
    model_dir = os.path.join(args.dir, "model")
    out: dict[str, Any] = {}
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        out["write"] = write_checkpoint(model_dir, args.params)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    if not cfg.get("architectures"):  # TRL's loader picks the class by it (as transformers' save_pretrained sets it)
        cfg["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    out["model"] = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")}
    for which in ("plain", "zeroinf", "zeroinf_lean"):
        cmd = [sys.executable, __file__, "--child", which, "--dir", args.dir, "--dtype", args.dtype,
               "--lora-rank", str(args.lora_rank), "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        out[which] = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    for which in ("zeroinf", "zeroinf_lean"):
        out[f"rss_ratio_plain_over_{which}"] = out["plain"]["peak_rss_above_bytes"] / out[which]["peak_rss_above_bytes"]
    out["step_ratio_zeroinf_over_plain"] = out["zeroinf"]["median_step_s"] / out["plain"]["median_step_s"]
    out["cpu"] = cpu_name()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
