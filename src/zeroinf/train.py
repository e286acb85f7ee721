"""`zeroinf train`: a plain training function for the demo GPT on a byte corpus.

The loop is an ordinary PyTorch loop with the two zeroinf lines (`zeroinf.shard`, `zeroinf.AdamW`);
it runs unchanged on one process or under torchrun. Rank 0 shows a progress bar and prints the
summary; every rank returns the same `TrainResult` (losses are averaged across ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeroinf
import zeroinf.checkpoint
from zeroinf.checkpoint.saving import finish_pending_save
from zeroinf.comm import naming_failures
from zeroinf.config import Config
from zeroinf.data import DEFAULT_MAX_CORPUS_BYTES, BatchSampler, load_corpus, split_corpus
from zeroinf.memory import format_bytes, ssd_wear
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.optim.sharded import ShardedOptimizerBase
from zeroinf.telemetry import phase_scope, record_phases
from zeroinf.topology import Topology

TIER_NAMES = ("device", "host", "nvme")

DEFAULT_CONFIG = Config(stage=2, param_dtype="auto", grad_clip_norm=1.0)
"""The engine settings of `zeroinf train` when no config is given: bf16 compute where the device runs
it natively, else fp32 (a CPU without bf16 instructions runs the demo ~4x slower in bf16)."""


def _is_int(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_number(value: object, low: float, high: float = math.inf) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def check_run_numbers(args: Any) -> None:
    """The numbers `zeroinf train` and `zeroinf finetune` share, checked before any work starts:
    `log_interval = 0` stopped a run at its first step with a ZeroDivisionError, a negative warm-up
    or a `min_lr_ratio` above 1 trained with a schedule nobody asked for."""
    checks = [
        ("steps", args.steps is None or _is_int(args.steps, 1), "use a positive number of optimizer steps"),
        ("global_batch", _is_int(args.global_batch, 1), "use a positive number of sequences"),
        ("seq_len", _is_int(args.seq_len, 1), "use a positive number of tokens"),
        ("lr", _is_number(args.lr, 0.0), "use a learning rate >= 0"),
        ("min_lr_ratio", _is_number(args.min_lr_ratio, 0.0, 1.0), "use a number in [0, 1]"),
        ("warmup_steps", _is_int(args.warmup_steps, 0), "use 0 or a positive number of steps"),
        ("weight_decay", _is_number(args.weight_decay, 0.0), "use a number >= 0"),
        ("log_interval", _is_int(args.log_interval, 1), "use a positive number of steps"),
        ("save_every", _is_int(args.save_every, 0), "use 0 (never) or a positive number of steps"),
        ("keep_last", _is_int(args.keep_last, 0), "use 0 (keep every checkpoint) or a positive number"),
    ]
    for name, ok, fix in checks:
        if not ok:
            flag = _FLAGS.get(name)
            raise ValueError(f"{name} = {getattr(args, name)!r}{f' ({flag})' if flag else ''} is invalid: {fix}")
    if len(args.betas) != 2 or not all(_is_number(b, 0.0) and b < 1.0 for b in args.betas):
        raise ValueError(f"betas = {args.betas!r} is invalid: use two numbers in [0, 1)")
    if args.save_every and not args.save_dir:
        raise ValueError(f"--save-every {args.save_every} needs --save-dir: where to write the checkpoints")


# The command line's flags for the fields it exposes (the others are settable from Python only).
_FLAGS = {
    "steps": "--steps", "global_batch": "--batch", "seq_len": "--seq-len", "lr": "--lr", "warmup_steps": "--warmup",
    "weight_decay": "--weight-decay", "save_every": "--save-every", "keep_last": "--keep-last",
}


@dataclass
class TrainArgs:
    """Settings of one training run; the CLI's defaults are these."""

    model: str = "small"
    """GPT preset name (see `zeroinf.models.gpt.PRESETS`)."""
    n_layer: int | None = None
    """Override the preset's number of blocks."""
    n_head: int | None = None
    """Override the preset's number of attention heads."""
    d_model: int | None = None
    """Override the preset's residual width."""
    steps: int = 400
    """Optimizer steps."""
    global_batch: int = 32
    """Sequences per optimizer step, summed over ranks and micro-steps."""
    seq_len: int = 128
    """Tokens (bytes) per sequence; also the model's context length."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at `lr * min_lr_ratio`."""
    warmup_steps: int = 30
    """Steps of linear warm-up from 0 to `lr`."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices (biases and LayerNorms get none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    seed: int = 0
    """Seed of the model init and of the batches."""
    config: Config | str | None = None
    """Engine config, or the path of a TOML/JSON file; None means `DEFAULT_CONFIG`."""
    deepspeed: str | dict[str, Any] | None = None
    """A DeepSpeed JSON config or its dict (the engine settings come through `config`,
    `Config.from_deepspeed`): where it has an `optimizer` section, that section and its `scheduler`
    section make the optimizer and the LR schedule as DeepSpeed's engine does
    (`zeroinf.optimizer_from_deepspeed`), in place of lr, betas, weight_decay, warmup_steps and
    min_lr_ratio, which fill only its "auto" values (`DEEPSPEED_AUTO`); without a scheduler section
    the learning rate stays constant, as under DeepSpeed."""
    data: list[str] | None = None
    """Text files to train on; None means the Python standard library's sources."""
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES
    """Read at most this many bytes of the corpus."""
    val_fraction: float = 0.05
    """Trailing fraction of the corpus held out for validation."""
    eval_batches: int = 8
    """Global batches of the validation split evaluated at the end (0 skips evaluation)."""
    log_interval: int = 10
    """Steps between progress-bar updates of the loss, throughput and memory."""
    progress: bool = True
    """Show the progress bar and print the summary on rank 0."""
    report_path: str | None = None
    """Write the summary as JSON to this file (rank 0), and beside it one steady step's timeline
    (`<stem>.timeline.html`, `<stem>.trace.json`) with the planner's prediction for the run."""
    report_step: int | None = None
    """The step whose timeline the report shows (default: the third this run takes, or its last)."""
    save_every: int = 0
    """Save a checkpoint to `save_dir` every this many steps (0: never)."""
    save_dir: str | None = None
    """Checkpoint root for `save_every` (step folders and a `latest` pointer)."""
    keep_last: int = 0
    """Keep only this many checkpoints in `save_dir`, the newest (0: all); `zeroinf.save`'s `keep_last`."""
    save_node_local: bool = False
    """`save_dir` is each machine's own disk, not one every rank sees (`zeroinf.save`'s `node_local`)."""
    resume: str | None = None
    """Checkpoint root (its `latest`) or step folder to resume from: model, optimizer, LR schedule, RNG
    and data position; any world size, stage and offload placement. The run continues to `steps`."""
    init_from: str | None = None
    """Checkpoint whose weights (its fp32 masters) this run starts from, with a new optimizer, LR
    schedule and data order from step 0 (`zeroinf.load` of the weights alone, before the optimizer
    exists): a new phase of training. Not with `resume`, which continues the saving run."""

    def __post_init__(self) -> None:
        check_run_numbers(self)
        if self.init_from and self.resume:
            raise ValueError(
                "--init-from and --resume both given: --resume continues a run (its optimizer, schedule and data "
                "position), --init-from starts a new one from a checkpoint's weights; use one"
            )
        for name in ("n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, 1):
                raise ValueError(f"{name} = {value!r} (--{name.replace('_', '-')}) is invalid: use a positive integer")
        if not _is_int(self.max_corpus_bytes, 1):
            raise ValueError(f"max_corpus_bytes = {self.max_corpus_bytes!r} is invalid: use a positive byte count")
        if not _is_int(self.eval_batches, 0):
            raise ValueError(f"eval_batches = {self.eval_batches!r} is invalid: use 0 (no evaluation) or a count")

    def engine_config(self) -> Config:
        if self.config is None:
            return DEFAULT_CONFIG
        return self.config if isinstance(self.config, Config) else Config.load(self.config)

    def model_config(self) -> GPTConfig:
        return GPTConfig.preset(
            self.model, n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model, seq_len=self.seq_len
        )


@dataclass
class TrainResult:
    """What a run measured; the same on every rank except `memory` (each rank's own ledger)."""

    losses: list[float]
    """Training loss of each step this run took (nats per byte), averaged over micro-steps and ranks."""
    start_step: int
    """The first step this run took: 0, or the step of the checkpoint it resumed from."""
    step_times_s: list[float]
    """Wall time of each step on this rank."""
    first_loss: float
    last_loss: float
    """Mean loss of the last min(10, steps) steps (a single step's loss is noisy)."""
    val_loss: float | None
    tokens_per_s: float
    """Mean global throughput, the first (warm-up) step excluded when there are several."""
    wall_time_s: float
    """Time of the whole run: setup, steps and evaluation."""
    skipped_steps: int
    """Steps skipped by the fp16 loss scaler."""
    param_count: int
    world_size: int
    memory: dict[str, Any] = field(default_factory=dict)
    """`zeroinf.memory_report(model)` at the end of the run."""

    def summary(self) -> dict[str, Any]:
        """Plain data for the JSON report (per-step losses included)."""
        return dataclasses.asdict(self)


def format_step_io(io: dict[str, Any]) -> str:
    """The progress line's NVMe part: the last step's bytes, bytes per parameter, disk-busy share."""
    last = io.get("last_step")
    if not last or not (last["read_bytes"] or last["written_bytes"]):
        return ""
    return (
        f", nvme r/w {format_bytes(last['read_bytes'])}/{format_bytes(last['written_bytes'])} per step "
        f"({last['bytes_per_param']:.1f} B/param), disk busy {100 * last['disk_busy_share']:.0f}%"
    )


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step`: linear warm-up, then cosine decay to `min_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(topo: Topology) -> None:
    """Give each of the ranks on this machine its share of the cores, so gloo ranks don't oversubscribe."""
    if topo.device.type != "cpu" or not topo.is_distributed:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", topo.world_size))
    torch.set_num_threads(max(1, available_cores() // local_world))


# What a DeepSpeed section's "auto" values become in `zeroinf train` and `finetune`, from the run's
# own settings, as the Hugging Face Trainer fills them from TrainingArguments: (section, key) -> field.
DEEPSPEED_AUTO = {
    ("optimizer", "lr"): "lr", ("optimizer", "betas"): "betas", ("optimizer", "weight_decay"): "weight_decay",
    ("scheduler", "warmup_max_lr"): "lr", ("scheduler", "warmup_num_steps"): "warmup_steps",
    ("scheduler", "total_num_steps"): "steps",
}
DEEPSPEED_AUTO_CONSTANTS = {("optimizer", "eps"): 1e-8, ("scheduler", "warmup_min_lr"): 0.0}


def deepspeed_sections(source: str | dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The `optimizer` and `scheduler` sections of a DeepSpeed config (absent ones left out)."""
    if source is None:
        return {}
    from zeroinf.deepspeed_config import read_deepspeed

    data, _ = read_deepspeed(source)
    return {name: dict(data[name]) for name in ("optimizer", "scheduler") if isinstance(data.get(name), dict)}


def deepspeed_optimizer(
    source: str | dict[str, Any] | None, groups: list[dict[str, Any]], run: Any = None
) -> tuple[ShardedOptimizerBase, torch.optim.lr_scheduler.LRScheduler] | None:
    """The optimizer and LR schedule a DeepSpeed config's `optimizer` and `scheduler` sections make over
    `groups` (a group's own weight decay, 0 for biases and norms, stays; the section's applies to the
    others), and a constant schedule where it has no scheduler section, as DeepSpeed's engine keeps
    the learning rate then; None without a config or without an optimizer section. Its "auto" values
    come from `run`'s settings (`DEEPSPEED_AUTO`), as the Hugging Face Trainer fills them."""
    sections = deepspeed_sections(source)
    if "optimizer" not in sections:
        return None
    for name, section in sections.items():
        params = dict(section.get("params") or {})
        for key, value in params.items():
            if value == "auto" and (name, key) in DEEPSPEED_AUTO and run is not None:
                params[key] = getattr(run, DEEPSPEED_AUTO[(name, key)])
            elif value == "auto" and (name, key) in DEEPSPEED_AUTO_CONSTANTS:
                params[key] = DEEPSPEED_AUTO_CONSTANTS[(name, key)]
        section["params"] = params
    decayed = [{k: v for k, v in g.items() if not (k == "weight_decay" and v)} for g in groups]
    opt, sched = zeroinf.optimizer_from_deepspeed(decayed, sections)
    assert isinstance(opt, ShardedOptimizerBase)  # zeroinf's Adam(W), or a torch optimizer over the shards
    return opt, sched if sched is not None else torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (Linear weights, embeddings); none on biases and LayerNorm weights."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def mean_over_ranks(value: float, topo: Topology) -> float:
    """`value` averaged over all ranks (itself in a single process)."""
    if not topo.is_distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=topo.device)
    with naming_failures("loss all-reduce", 1, topo):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.group)
    return float(tensor.item()) / topo.world_size


def format_memory(report: dict[str, Any], all_tiers: bool = False) -> str:
    """Peak bytes per tier of a memory report, 'device 12.3 MiB, host 1.0 GiB' (empty tiers left out)."""
    parts = [
        f"{tier} {format_bytes(report[tier]['peak_bytes'])}"
        for tier in TIER_NAMES
        if tier in report and (all_tiers or report[tier]["peak_bytes"])
    ]
    return ", ".join(parts) or "0 B"


@torch.no_grad()
def evaluate(model: torch.nn.Module, sampler: BatchSampler, n_batches: int, topo: Topology) -> float:
    """Mean loss over `n_batches` global batches of `sampler`, averaged over ranks; restores train mode."""
    was_training = model.training
    model.eval()
    total = 0.0
    for step in range(n_batches):
        for inputs, targets in sampler.micro_batches(step):
            loss = model(inputs.to(topo.device), targets.to(topo.device))
            total += float(loss) / sampler.grad_accum_steps
    model.train(was_training)
    return mean_over_ranks(total / max(1, n_batches), topo)


@dataclass
class Run:
    """What one training run is made of, built by `build_run`."""

    topo: Topology
    cfg: Config
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    train_sampler: BatchSampler
    val_sampler: BatchSampler | None
    param_count: int
    corpus_bytes: int
    start_note: str = ""
    """Printed before the first step: with "auto" placement fields the chosen placement and its
    prediction; with `init_from` the checkpoint the weights came from."""


def build_run(args: TrainArgs) -> Run:
    """Join the ranks, read the corpus, build and shard the model, and make its optimizer and schedule."""
    cfg = args.engine_config()
    topo = zeroinf.init_distributed(timeout_s=cfg.collective_timeout_s)
    set_cpu_threads(topo)
    start_note = ""
    if cfg.is_auto:  # the fastest predicted placement that fits, before any memory is touched
        from zeroinf.planner.api import resolve_for_ranks
        from zeroinf.planner.model_facts import from_gpt_config
        from zeroinf.planner.report import format_estimate

        cfg, chosen = resolve_for_ranks(
            cfg, from_gpt_config(args.model_config(), name=f"GPT {args.model}"), topo,
            tokens_per_step=args.global_batch * args.seq_len, seq_len=args.seq_len,
        )
        if chosen is not None and chosen.best is not None:
            start_note = f"auto placement (zeroinf plan): {format_estimate(chosen.best)}"
    corpus = load_corpus(args.data, args.max_corpus_bytes)
    train_bytes, val_bytes = split_corpus(corpus, args.val_fraction)

    def sampler(data: torch.Tensor) -> BatchSampler:
        return BatchSampler(
            data,
            args.seq_len,
            args.global_batch,
            seed=args.seed,
            rank=topo.rank,
            world_size=topo.world_size,
            grad_accum_steps=cfg.grad_accum_steps,
        )

    use_val = args.eval_batches > 0 and len(val_bytes) > args.seq_len
    torch.manual_seed(args.seed)
    with zeroinf.init(cfg, topology=topo):  # the full model never exists: 1/world of it on its tier
        model = GPT(args.model_config())
    param_count = model.num_params()
    # Grouped by shape before sharding: at stage 3 a parameter outside its forward is an empty
    # placeholder of shape (0,), so `p.dim()` no longer tells matrices from vectors.
    groups = param_groups(model, args.weight_decay)
    model = zeroinf.shard(model, cfg, topology=topo)
    if args.init_from:  # before the optimizer: it takes the checkpoint's fp32 masters as its own
        info = zeroinf.load(args.init_from, model, load_rng=False)
        start_note = "\n".join(filter(None, [start_note, f"weights from {info['path']} (step {info['step']})"]))
    from_file = deepspeed_optimizer(args.deepspeed, groups, args)
    if from_file is not None:
        opt, sched = from_file
    else:
        opt = zeroinf.AdamW(model, lr=args.lr, betas=args.betas, weight_decay=args.weight_decay, param_groups=groups)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: lr_factor(step, args.warmup_steps, args.steps, args.min_lr_ratio)
        )
    return Run(
        topo,
        cfg,
        model,
        opt,
        sched,
        sampler(train_bytes),
        sampler(val_bytes) if use_val else None,
        param_count,
        len(corpus),
        start_note,
    )


def train_step(run: Run, step: int) -> float:
    """One optimizer step over this rank's micro-batches; returns the loss averaged over ranks."""
    device = run.topo.device
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in run.train_sampler.micro_batches(step):
        with phase_scope("zeroinf::forward"):
            loss = run.model(inputs.to(device), targets.to(device)) / run.cfg.grad_accum_steps
        run.opt.backward(loss)  # type: ignore[attr-defined]
        loss_sum += loss.detach().float()
    run.opt.step()
    run.opt.zero_grad()
    run.sched.step()
    return mean_over_ranks(float(loss_sum), run.topo)


def train(args: TrainArgs) -> TrainResult:
    """Train the demo GPT as `args` says; rank 0 shows progress and prints the summary."""
    start_s = time.perf_counter()
    run = build_run(args)
    show = args.progress and run.topo.rank == 0
    if show:
        if run.start_note:
            print(run.start_note, flush=True)
        print(describe(args, run), flush=True)
    timeline: dict[str, Any] = {}
    try:
        start_step = resume(run, args.resume, show) if args.resume else 0
        losses: list[float] = []
        step_times_s: list[float] = []
        skipped_steps = 0
        saved = ""
        run.model.train()
        bar = tqdm(total=args.steps, initial=start_step, disable=not show, unit="step", dynamic_ncols=True)
        report_step = timeline_step(args, start_step)
        for step in range(start_step, args.steps):
            step_start_s = time.perf_counter()
            if step == report_step:
                loss, timeline = recorded_step(functools.partial(train_step, run, step), run.model, step)
            else:
                loss = train_step(run, step)
            losses.append(loss)
            step_times_s.append(time.perf_counter() - step_start_s)
            skipped_steps += int(run.opt.last_step_skipped)  # type: ignore[attr-defined]
            bar.update(1)
            if args.save_every and (step + 1) % args.save_every == 0:
                saved = save(run, args.save_dir or "", step + 1, args.keep_last, args.save_node_local)
            if show and (step % args.log_interval == 0 or step == args.steps - 1):
                tokens_per_s = run.train_sampler.tokens_per_step / step_times_s[-1]
                report = zeroinf.memory_report(run.model)
                memory = format_memory(report)
                skipped = f", skipped {skipped_steps}" if skipped_steps else ""
                nvme = format_step_io(report["io"])
                bar.set_postfix_str(
                    f"loss {losses[-1]:.3f}, {tokens_per_s:,.0f} tok/s, mem {memory}{nvme}{skipped}{saved}"
                )
        bar.close()
        finish_pending_save(run.opt)  # the last checkpoint, before evaluation
        if not losses:
            raise ValueError(f"nothing to train: the run resumed at step {start_step} and --steps is {args.steps}")

        val_loss = None
        if run.val_sampler is not None:
            val_loss = evaluate(run.model, run.val_sampler, args.eval_batches, run.topo)
        timed_s = step_times_s[1:] or step_times_s  # the first step includes one-time warm-up
        tail = losses[-min(10, len(losses)) :]
        result = TrainResult(
            losses=losses,
            start_step=start_step,
            step_times_s=step_times_s,
            first_loss=losses[0],
            last_loss=sum(tail) / len(tail),
            val_loss=val_loss,
            tokens_per_s=run.train_sampler.tokens_per_step * len(timed_s) / sum(timed_s),
            wall_time_s=time.perf_counter() - start_s,
            skipped_steps=skipped_steps,
            param_count=run.param_count,
            world_size=run.topo.world_size,
            memory=zeroinf.memory_report(run.model),
        )
    finally:  # free the swap files and I/O threads now: a later run in this process may reuse the folder
        run.opt.close()  # type: ignore[attr-defined]
        zeroinf.engine_of(run.model).close()
    if show:
        print_summary(result)
    if args.report_path and run.topo.rank == 0:
        step_report = (lambda: write_timeline(args, run, timeline)) if timeline else None
        write_report(args, run.cfg, result.summary(), step_report, show)
    return result


def recorded_step(step: Callable[[], float], model: torch.nn.Module, index: int) -> tuple[float, dict[str, Any]]:
    """Run one training step under the phase recorder: its loss, and the timeline `--report` draws."""
    with record_phases() as recorder:
        loss = step()
    return loss, {"recorder": recorder, "step": index, "ledger": zeroinf.memory_report(model)["last_step"]}


def write_report(
    args: Any, cfg: Config, summary: dict[str, Any], step_report: Callable[[], dict[str, Any]] | None, show: bool
) -> None:
    """`--report`: the run's arguments, engine config and summary as JSON (its folder created), with
    the recorded step's timeline written beside it by `step_report` (train and finetune share this)."""
    path = Path(args.report_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": dataclasses.asdict(args), "engine_config": cfg.to_dict(), **summary}
    if step_report is not None:
        report["step_report"] = step_report()
        if show:
            print(f"step timeline: {report['step_report']['timeline_html']}", flush=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def timeline_step(args: TrainArgs, start_step: int) -> int | None:
    """The step a report's timeline shows: a steady one (the third this run takes), or `report_step`."""
    if not args.report_path:
        return None
    if args.report_step is not None:
        return args.report_step
    return start_step + min(2, max(0, args.steps - start_step - 1))


def write_timeline(args: TrainArgs, run: Run, timeline: dict[str, Any]) -> dict[str, Any]:
    """The recorded step's timeline beside the report, with the plan's prediction for this run."""
    from zeroinf.planner.model_facts import from_gpt_config
    from zeroinf.planner.timeline import write_run_timeline

    return write_run_timeline(
        run.model, lambda: from_gpt_config(args.model_config(), name=f"GPT {args.model}"),
        args.global_batch * args.seq_len, args.seq_len, timeline, args.report_path,
        f"zeroinf train: step {timeline['step']} of GPT {args.model}",
        [describe(args, run), placement_line(run.cfg), "rank 0 of the run; times are wall-clock"],
        run.topo.rank,
    )


def placement_line(cfg: Config) -> str:
    o = cfg.offload
    ckpt = ", activation checkpointing" if cfg.activation_checkpointing else ""
    return f"placement: stage {cfg.stage}, params {o.params}, optimizer {o.optimizer}, gradients {o.gradients}{ckpt}"


def save(run: Run, root: str, step: int, keep_last: int = 0, node_local: bool = False) -> str:
    """Checkpoint after `step` steps (a collective), written in the background while the next step's
    forward and backward run; the next `opt.step()` finishes it (and then removes the checkpoints
    beyond the `keep_last` newest, when > 0); `node_local`: `root` is each machine's own disk.
    Returns a progress-bar note."""
    previous = finish_pending_save(run.opt)  # normally done by the last step
    extra = {"lr_schedule": run.sched.state_dict()}
    zeroinf.checkpoint.save(
        root, run.model, run.opt, step=step, extra=extra, blocking=False, keep_last=keep_last or None,
        node_local=node_local,
    )
    done = f", saved {os.path.basename(previous)}" if previous else ""
    return f"{done}, saving step {step} in the background"


def resume(run: Run, path: str, show: bool) -> int:
    """Load a checkpoint into the run; returns the step to continue from (the data position)."""
    info = zeroinf.checkpoint.load(path, run.model, run.opt)
    run.sched.load_state_dict((info["extra"] or {})["lr_schedule"])
    if show:
        print(f"resumed from {info['path']} at step {info['step']} (saved by {info['world_size']} rank(s))", flush=True)
    return int(info["step"])


def describe(args: TrainArgs, run: Run) -> str:
    """The one-line header of a run."""
    return (
        f"zeroinf train: GPT {args.model} {run.param_count / 1e6:.2f}M params, {run.topo.world_size} "
        f"rank(s), stage {run.cfg.stage}, {run.cfg.param_dtype}, {args.steps} steps x {args.global_batch} "
        f"seqs x {args.seq_len} bytes, corpus {format_bytes(run.corpus_bytes)}"
    )


def print_summary(result: TrainResult) -> None:
    """The end-of-run summary (rank 0)."""
    lines = [
        f"loss: {result.first_loss:.3f} at the first step -> {result.last_loss:.3f} "
        f"(mean of the last {min(10, len(result.losses))} steps) nats/byte",
        f"val loss: {result.val_loss:.3f} nats/byte" if result.val_loss is not None else "val loss: not evaluated",
        f"throughput: {result.tokens_per_s:,.0f} tokens/s over {result.world_size} rank(s); "
        f"wall time {result.wall_time_s:.1f} s",
        f"peak engine memory per rank: {format_memory(result.memory, all_tiers=True)}",
        f"skipped steps (fp16 overflow): {result.skipped_steps}",
    ]
    io = result.memory.get("io", {})
    if io.get("nvme_read_bytes") or io.get("nvme_written_bytes"):
        lines.append(
            f"nvme: read {format_bytes(io['nvme_read_bytes'])}, written {format_bytes(io['nvme_written_bytes'])}, "
            f"waited {io['io_wait_s']:.1f} s of {io['io_busy_s']:.1f} s in flight: "
            f"{io['overlap_pct']:.0f}% of I/O hidden behind compute"
        )
        if io.get("nvme_written_bytes") and result.losses:  # per rank; the first step's writes include setup's
            lines.append(f"nvme per rank: about {ssd_wear(io['nvme_written_bytes'] / len(result.losses))}")
    print("\n".join(lines), flush=True)
