"""Shared pieces of the offload benchmarks: build the demo GPT, time steps, read memory figures.

Benchmarks print one JSON object; they are run by hand (never by the test suite) and their
results are recorded with the command that made them.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

import zeroinf
from zeroinf.models.gpt import GPT, GPTConfig


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass
class Run:
    model: GPT
    opt: zeroinf.AdamW
    gpt: GPTConfig
    batch: int


def build(gpt: GPTConfig, cfg: zeroinf.Config, batch: int, seed: int = 0, lr: float = 1e-4) -> Run:
    torch.manual_seed(seed)
    with zeroinf.init(cfg):
        model = GPT(gpt)
    zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return Run(model, opt, gpt, batch)


def batch_for(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, run.gpt.vocab_size, (run.batch, run.gpt.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train_step(run: Run, step: int) -> tuple[float, float]:
    """One optimizer step; returns (seconds, loss)."""
    x, y = batch_for(run, step)
    t0 = time.perf_counter()
    loss = run.model(x, y)
    run.opt.backward(loss)
    run.opt.step()
    run.opt.zero_grad()
    return time.perf_counter() - t0, loss.item()


def close(run: Run) -> None:
    zeroinf.engine_of(run.model).close()
    states = getattr(run.opt, "states", None)
    if states is not None and hasattr(states, "close"):
        states.close()
    del run.model, run.opt
    gc.collect()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name()}


def add_offload_args(parser: argparse.ArgumentParser, preset: str, seq_len: int) -> None:
    """The options of the fully offloaded GPT benchmarks: swap folder, model size, batch, steps."""
    parser.add_argument("--nvme-dir", required=True)
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch", type=int, default=2)


def add_step_memory_args(parser: argparse.ArgumentParser) -> None:
    """The step-memory options the allocator benchmarks compare: `--reuse-step-memory`
    (Config.reuse_step_memory) and `--grad-pool off` (every gradient buffer allocated afresh)."""
    parser.add_argument(
        "--reuse-step-memory", default="auto", choices=["auto", "true", "false"],
        help="Config.reuse_step_memory",
    )
    parser.add_argument(
        "--grad-pool", default="on", choices=["on", "off"],
        help="off: every gradient buffer allocated afresh (the engine's grad_pool disabled), to compare",
    )


def reuse_step_memory(a: argparse.Namespace) -> bool | str:
    """`--reuse-step-memory` as the Config field's value."""
    return {"auto": "auto", "true": True, "false": False}[a.reuse_step_memory]


def apply_grad_pool(run: Run, a: argparse.Namespace) -> None:
    """`--grad-pool` on the built engine (partition/grad_pool.py)."""
    zeroinf.engine_of(run.model).grad_pool.enabled = a.grad_pool == "on"


def offloaded_run(n_layer: int, d_model: int, seq_len: int, batch: int, steps: int, nvme_dir: str) -> dict[str, Any]:
    """Build (under zeroinf.init) and train a fully offloaded demo GPT; memory and time figures.

    Stage 3, bf16, activation checkpointing; parameters, gradient shards and optimizer states on NVMe.
    Run it in a fresh process: the peak RSS is the process's high-water mark.
    """
    gpt = GPTConfig(seq_len=seq_len, n_layer=n_layer, n_head=max(1, d_model // 64), d_model=d_model)
    cfg = zeroinf.Config(
        stage=3, param_dtype="bf16", activation_checkpointing=True, persist_threshold_bytes=0,
        offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=nvme_dir),
    )
    t0 = time.perf_counter()
    run = build(gpt, cfg, batch)
    build_s = time.perf_counter() - t0
    build_peak = peak_rss_bytes()
    step_s, losses = [], []
    for step in range(steps):
        seconds, loss = train_step(run, step)
        step_s.append(seconds)
        losses.append(loss)
    report = zeroinf.memory_report(run.model)
    out = {
        "params": gpt.param_count, "n_layer": n_layer, "d_model": d_model, "tokens_per_step": batch * seq_len,
        "build_s": build_s, "step_s": step_s, "losses": losses,
        "peak_rss_bytes": peak_rss_bytes(), "build_peak_rss_bytes": build_peak, "rss_after_bytes": rss_bytes(),
        "ledger": {t: report[t] for t in ("device", "host", "nvme")},
    }
    close(run)
    return out
