"""`zeroinf finetune`: fine-tune a Hugging Face model folder on your text, LoRA or full, beyond memory.

    zeroinf finetune --model ./llama --data notes.jsonl --lora-rank 16 --steps 200 --out ./llama-tuned \\
        --stage 3 --offload-params nvme --offload-optimizer nvme --nvme-dir /mnt/nvme/zi

1. Text: `.txt` files (each file a document) or `.jsonl` files (each line a JSON object; its
   `--text-field` is a document), tokenized with the model folder's own tokenizer when it has one
   (else UTF-8 bytes, for byte-level vocabularies), each document followed by the end-of-sequence
   token, packed end to end, and cut into random windows of `--seq-len` tokens per step (the demo's
   sampler: deterministic per step, so a resume continues the same data).
2. The model comes from `zeroinf.from_pretrained` (streamed into its shards, never whole in memory),
   with LoRA adapters (`--lora-rank R`, peft) added before sharding: the base is frozen, sharded and
   offloaded like the rest, and only the adapters get optimizer state. `--lora-rank 0`: full fine-tune.
3. The loop is `zeroinf train`'s: AdamW, warm-up and cosine schedule, progress bar with memory and
   NVMe traffic, background checkpoints (`--save-every`, `--save-dir`) and `--resume`.
4. `--out DIR`: a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads: the LoRA
   weights merged into the base (the adapter is not kept separately), written one unit at a time,
   with `config.json`, the generation config and the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm

import zeroinf
import zeroinf.checkpoint
from zeroinf.checkpoint.saving import finish_pending_save
from zeroinf.config import Config
from zeroinf.data import BatchSampler
from zeroinf.optim.sharded import ShardedOptimizerBase
from zeroinf.optional import require
from zeroinf.telemetry import phase_scope
from zeroinf.train import TrainResult as FinetuneResult
from zeroinf.train import (
    check_run_numbers,
    deepspeed_optimizer,
    format_memory,
    lr_factor,
    mean_over_ranks,
    print_summary,
    recorded_step,
    resume,
    save,
    set_cpu_threads,
    write_report,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_CONFIG = Config(stage=3, grad_clip_norm=1.0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class FinetuneArgs:
    """Settings of one fine-tuning run; the CLI's defaults are these."""

    model: str
    """A Hugging Face model folder (config.json and safetensors weights; a tokenizer if it has one)."""
    data: list[str]
    """Text (.txt) or JSON-lines (.jsonl) files."""
    format: str = "auto"
    """text, jsonl, or auto (by each file's extension)."""
    text_field: str = "text"
    """The field of each JSON line that holds the document."""
    lora_rank: int = 8
    """Rank of the LoRA adapters; 0 fine-tunes every weight."""
    lora_alpha: float | None = None
    """LoRA scaling numerator (default: twice the rank)."""
    lora_targets: str = "all-linear"
    """Modules that get adapters: peft's `target_modules`, comma-separated names or `all-linear`."""
    steps: int | None = None
    """Optimizer steps (default: one epoch when --epochs is not given either)."""
    epochs: float | None = None
    """Passes over the packed tokens instead of --steps (a pass: tokens / (batch x seq_len) steps)."""
    seq_len: int = 256
    """Tokens per sequence."""
    global_batch: int = 8
    """Sequences per optimizer step, over all ranks and micro-steps."""
    lr: float = 2e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    """Seed of the adapters' init and of the batches."""
    config: Config | str | None = None
    """Engine config (or a TOML/JSON path); None: stage 3 with clipping at 1.0."""
    deepspeed: str | dict[str, Any] | None = None
    """A DeepSpeed config whose optimizer and scheduler sections make the optimizer and schedule,
    as `zeroinf.train.TrainArgs.deepspeed` says."""
    out: str | None = None
    """Write the fine-tuned model here as a Hugging Face folder."""
    save_every: int = 0
    save_dir: str | None = None
    keep_last: int = 0
    save_node_local: bool = False  # save_dir is each machine's own disk (zeroinf.save's node_local)
    resume: str | None = None
    log_interval: int = 10
    progress: bool = True
    report_path: str | None = None

    def __post_init__(self) -> None:
        if self.format not in ("auto", "text", "jsonl"):
            raise ValueError(f"--format {self.format!r}: use text, jsonl or auto")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"--lora-rank {self.lora_rank}: use 0 (full fine-tune) or a positive rank")
        if self.epochs is not None and not (isinstance(self.epochs, (int, float)) and self.epochs > 0):
            raise ValueError(f"epochs = {self.epochs!r} (--epochs) is invalid: use a positive number of passes")
        check_run_numbers(self)
        if not self.data:
            raise ValueError("--data: give at least one .txt or .jsonl file")

    def engine_config(self) -> Config:
        if self.config is None:
            return DEFAULT_CONFIG
        return self.config if isinstance(self.config, Config) else Config.load(self.config)


def read_documents(files: list[str], fmt: str = "auto", text_field: str = "text") -> list[str]:
    """The documents of `files`: a .txt file is one document, a .jsonl line one document."""
    docs = []
    for path in files:
        kind = fmt if fmt != "auto" else ("jsonl" if path.endswith((".jsonl", ".json")) else "text")
        with open(path, encoding="utf-8") as f:
            if kind == "text":
                docs.append(f.read())
                continue
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path}:{number}: no text field {text_field!r} (set --text-field)")
                docs.append(record[text_field])
    return docs


def tokenize(docs: list[str], model_dir: str, vocab_size: int) -> tuple[torch.Tensor, Any]:
    """All documents packed into one int64 tensor of token ids (and the tokenizer, or None)."""
    tokenizer = None
    if any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        transformers = require("transformers", "zeroinf finetune")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for doc in docs:
        if tokenizer is not None:
            ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
            if tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
        else:
            if vocab_size < 256:
                raise ValueError(f"{model_dir}: no tokenizer files and a vocabulary of {vocab_size} < 256 bytes")
            ids.extend(doc.encode("utf-8"))
    return torch.tensor(ids, dtype=torch.int64), tokenizer


def lora_prepare(args: FinetuneArgs) -> Any:
    """`prepare` for `from_pretrained`: peft's LoRA on the targets, or None for a full fine-tune."""
    if args.lora_rank == 0:
        return None
    peft = require("peft", "zeroinf finetune --lora-rank")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    targets: str | list[str] = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    config = LoraConfig(
        r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, target_modules=targets,
        lora_dropout=0.0, task_type="CAUSAL_LM",
    )
    return lambda model: get_peft_model(model, config)


@dataclass
class FinetuneRun:
    topo: zeroinf.Topology
    cfg: Config
    model: torch.nn.Module
    opt: ShardedOptimizerBase  # zeroinf.AdamW, or what a DeepSpeed config's optimizer section makes
    sched: torch.optim.lr_scheduler.LRScheduler
    sampler: BatchSampler
    tokenizer: Any
    param_count: int
    steps: int
    extra: dict[str, Any] = field(default_factory=dict)


def build_run(args: FinetuneArgs) -> FinetuneRun:
    AutoConfig = require("transformers", "zeroinf finetune").AutoConfig

    topo = zeroinf.init_distributed()
    set_cpu_threads(topo)
    cfg = args.engine_config()
    vocab = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size  # a VLM's is its text model's
    tokens, tokenizer = tokenize(read_documents(args.data, args.format, args.text_field), args.model, vocab)
    sampler = BatchSampler(
        tokens, args.seq_len, args.global_batch, seed=args.seed, rank=topo.rank, world_size=topo.world_size,
        grad_accum_steps=cfg.grad_accum_steps,
    )
    steps = args.steps
    if steps is None:
        steps = max(1, math.ceil((args.epochs or 1.0) * len(tokens) / sampler.tokens_per_step))
    torch.manual_seed(args.seed)
    model = zeroinf.from_pretrained(args.model, cfg, prepare=lora_prepare(args), topology=topo)
    engine = zeroinf.engine_of(model)
    param_count = sum(u.layout.numel for u in engine.all_units)
    trainable = [p for p in model.parameters() if p.requires_grad]
    from_file = deepspeed_optimizer(args.deepspeed, [{"params": trainable}], dataclasses.replace(args, steps=steps))
    if from_file is not None:
        opt, sched = from_file
    else:
        opt = zeroinf.AdamW(model, lr=args.lr, betas=args.betas, weight_decay=args.weight_decay,
                            param_groups=[{"params": trainable}])
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, args.warmup_steps, steps, args.min_lr_ratio)
        )
    return FinetuneRun(topo, cfg, model, opt, sched, sampler, tokenizer, param_count, steps)


def causal_lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 (targets are the inputs shifted by one already)."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train_step(run: FinetuneRun, step: int) -> float:
    device = run.topo.device
    total = torch.zeros((), device=device)
    for inputs, targets in run.sampler.micro_batches(step):
        with phase_scope("zeroinf::forward"):
            loss = causal_lm_loss(run.model, inputs.to(device), targets.to(device)) / run.cfg.grad_accum_steps
        run.opt.backward(loss)
        total += loss.detach()
    run.opt.step()
    run.opt.zero_grad()
    run.sched.step()
    return mean_over_ranks(float(total), run.topo)


def finetune(args: FinetuneArgs) -> FinetuneResult:
    """Fine-tune as `args` says; rank 0 shows progress, prints the summary and writes `--out`."""
    start_s = time.perf_counter()
    run = build_run(args)
    show = args.progress and run.topo.rank == 0
    if show:
        kind = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tune"
        print(f"zeroinf finetune: {args.model}, {run.param_count / 1e6:.2f}M params ({kind}), "
              f"{run.topo.world_size} rank(s), stage {run.cfg.stage}, {run.cfg.param_dtype}, {run.steps} steps x "
              f"{args.global_batch} x {args.seq_len} tokens, {len(run.sampler.data):,} tokens of text", flush=True)
    try:
        start_step = resume(run, args.resume, show) if args.resume else 0  # type: ignore[arg-type]
        losses: list[float] = []
        times: list[float] = []
        run.model.train()
        bar = tqdm(total=run.steps, initial=start_step, disable=not show, unit="step", dynamic_ncols=True)
        note = ""
        report_step = start_step + min(2, max(0, run.steps - start_step - 1)) if args.report_path else None
        timeline: dict[str, Any] = {}
        for step in range(start_step, run.steps):
            t0 = time.perf_counter()
            if step == report_step:
                loss, timeline = recorded_step(functools.partial(train_step, run, step), run.model, step)
            else:
                loss = train_step(run, step)
            losses.append(loss)
            times.append(time.perf_counter() - t0)
            bar.update(1)
            if args.save_every and (step + 1) % args.save_every == 0:
                note = save(
                    run, args.save_dir or "", step + 1, args.keep_last, args.save_node_local  # type: ignore[arg-type]
                )
            if show and (step % args.log_interval == 0 or step == run.steps - 1):
                memory = format_memory(zeroinf.memory_report(run.model))
                bar.set_postfix_str(f"loss {losses[-1]:.3f}, {run.sampler.tokens_per_step / times[-1]:,.0f} tok/s, "
                                    f"mem {memory}{note}")
        bar.close()
        finish_pending_save(run.opt)
        if not losses:
            raise ValueError(f"nothing to train: resumed at step {start_step} of {run.steps}")
        timed = times[1:] or times
        tail = losses[-min(10, len(losses)) :]
        result = FinetuneResult(
            losses=losses, start_step=start_step, step_times_s=times, first_loss=losses[0],
            last_loss=sum(tail) / len(tail), val_loss=None,
            tokens_per_s=run.sampler.tokens_per_step * len(timed) / sum(timed),
            wall_time_s=0.0, skipped_steps=0, param_count=run.param_count, world_size=run.topo.world_size,
            memory=zeroinf.memory_report(run.model),
        )
        if args.out:
            export(run, args)
        result.wall_time_s = time.perf_counter() - start_s
    finally:
        run.opt.close()
        zeroinf.engine_of(run.model).close()
    if show:
        print_summary(result)
        if args.out:
            print(f"wrote the fine-tuned model to {args.out}", flush=True)
    if args.report_path and run.topo.rank == 0:
        step_report = (lambda: write_timeline(args, run, timeline)) if timeline else None
        write_report(args, run.cfg, result.summary(), step_report, show)
    return result


def write_timeline(args: FinetuneArgs, run: FinetuneRun, timeline: dict[str, Any]) -> dict[str, Any]:
    """The recorded step's timeline beside the report, with the plan's prediction from the unit plan
    the engine built (frozen units included) and the model's config (its forward on meta tensors)."""
    from zeroinf.planner.model_facts import from_hf
    from zeroinf.planner.timeline import write_run_timeline
    from zeroinf.train import placement_line

    return write_run_timeline(
        run.model, lambda: from_hf(args.model), args.global_batch * args.seq_len, args.seq_len, timeline,
        args.report_path, f"zeroinf finetune: step {timeline['step']} of {args.model}",
        [placement_line(run.cfg), f"{run.param_count / 1e6:.2f}M parameters, LoRA rank {args.lora_rank}",
         "rank 0 of the run; times are wall-clock"],
        run.topo.rank,
    )


def write_merged(model: torch.nn.Module, out: str) -> PreTrainedModel:
    """Merge a peft model's adapters into its base weights (each tuner layer's `merge` runs
    gathered: integrations/peft_layers.py) and write the base's weights to `out` as transformers
    would save the merged model (`merge_and_unload()` then `save_pretrained`); returns the base
    model. A model without adapters is written as it is. A collective."""
    from zeroinf.integrations.peft_layers import tuner_layers
    from zeroinf.weights.export import save_pretrained_weights

    get_base_model = getattr(model, "get_base_model", None)  # a peft model's
    # A transformers model (`from_pretrained` loads one): the caller writes its config files.
    base = cast("PreTrainedModel", get_base_model() if get_base_model is not None else model)
    prefix = ""
    adapter_parts: set[str] = set()  # the attributes of tuner layers that hold adapters, not base weights
    if base is not model:
        prefix = next(n for n, m in model.named_modules() if m is base) + "."
        for layer in tuner_layers(base):
            layer.merge()
            adapter_parts.update(layer.adapter_layer_names, layer.other_param_names)

    def rename(name: str) -> str | None:
        if not name.startswith(prefix) or adapter_parts.intersection(name.split(".")):
            return None
        name = name[len(prefix) :]
        # a layer's base weight under its wrappers: nested ones where peft wraps one module twice
        # (LoRA on both fused expert parameters of an MoE layer: experts.base_layer.base_layer.down_proj)
        while ".base_layer." in name:
            name = name.replace(".base_layer.", ".")
        return name

    save_pretrained_weights(model, out, rename=rename, hub_layout_of=base)
    return base


def export(run: FinetuneRun, args: FinetuneArgs) -> None:
    """Merge the adapters into the base (inside `zeroinf.gathered`), write the base's weights under
    its own names, its config, generation config and tokenizer (a collective; rank 0 writes)."""
    from zeroinf.weights.save import write_configs

    out = args.out
    assert out is not None, "export writes to args.out: call it when that is set"
    base = write_merged(run.model, out)
    if run.topo.rank == 0:
        write_configs(base, out)
        if run.tokenizer is not None:
            run.tokenizer.save_pretrained(out)
    if run.topo.is_distributed:
        torch.distributed.barrier(group=run.topo.group)
