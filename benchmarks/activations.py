"""Activation memory held at the end of forward, and step time, for the demo GPT (24 blocks):
no checkpointing, activation checkpointing, checkpointing + offload of the kept inputs.

    PYTHONPATH=src python benchmarks/activations.py                      # defaults below
    PYTHONPATH=src python benchmarks/activations.py --d-model 192 --seq 256 --steps 9

One model per setting (same seed, same batches), sharded at `--stage` (default 2) on one process.
Settings alternate within each round (A B C A B C ...) so all see the same background load; the
first `--warmup` rounds are not timed, and the first of them is the measured forward.

How "activation bytes held at the end of forward" is measured (the measured forward only; the
timed steps run without any hook):
- device side: an outermost `torch.autograd.graph.saved_tensors_hooks` pair whose pack hook keeps
  the tensor itself (so nothing changes) plus a weak reference to it. At the end of forward the
  unique storages of the saved tensors still alive that are not parameter storage are summed
  (`untyped_storage().nbytes()`, so a saved view counts the whole storage it keeps alive). With
  checkpointing, the ops inside a checkpointed block save through the checkpoint's own, inner
  hooks (which keep no tensor), so this hook sees what the checkpoint keeps: its inputs. With
  offload, zeroinf's offload hooks sit between the two and receive those inputs instead; the hook
  here then sees only what runs outside checkpointed blocks (the root: embeddings, final
  LayerNorm, head, loss).
- host side: the ledger's live bytes of tag "activation_offload" on the host tier at the end of
  forward (what zeroinf's offloader holds).
- cross-check: the process RSS at the end of forward minus the RSS just before it (after
  `gc.collect()` and `malloc_trim`). It counts temporaries the allocator has not returned yet and,
  on a CPU-only machine, the offloaded host copies too (host and "device" are the same RAM there).
Also printed: the inputs the checkpoints keep, computed (`n_layer * batch * seq * d_model *
element size`), to check the hook's figures against.

Step time: forward + backward + optimizer step + zero_grad, median over `--steps` timed rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import zeroinf  # noqa: E402
from zeroinf.memory import Tier  # noqa: E402
from zeroinf.models.gpt import GPT, GPTConfig  # noqa: E402
from zeroinf.topology import Topology  # noqa: E402

SETTINGS = {
    "no_ckpt": {},
    "ckpt": {"activation_checkpointing": True},
    "ckpt_offload": {"activation_checkpointing": True, "offload_activations": True},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim() -> None:
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        if name:
            ctypes.CDLL(name).malloc_trim(0)


class SavedTensorMeter:
    """Outermost saved-tensor hooks: remember every saved tensor (weakly) without changing it."""

    def __init__(self, exclude_storages: set[int]) -> None:
        self.exclude = exclude_storages
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.packed = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        self.refs.append(weakref.ref(tensor))
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def live_bytes(self) -> tuple[int, int]:
        """(bytes of the unique non-parameter storages of saved tensors alive now, how many storages)."""
        storages: dict[int, int] = {}
        for ref in self.refs:
            t = ref()
            if t is None:
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr == 0 or ptr in self.exclude:
                continue
            storages[ptr] = s.nbytes()
        return sum(storages.values()), len(storages)


def build(name: str, args: argparse.Namespace, gpt_cfg: GPTConfig) -> dict:
    torch.manual_seed(0)
    cfg = zeroinf.Config(stage=args.stage, param_dtype=args.dtype, **SETTINGS[name])
    model = zeroinf.shard(GPT(gpt_cfg), cfg, Topology.single(torch.device("cpu")))
    opt = zeroinf.AdamW(model, lr=1e-4)
    return {"name": name, "model": model, "opt": opt, "times_s": [], "losses": []}


def batch(step: int, args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def measured_step(run: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    model, opt = run["model"], run["opt"]
    engine = zeroinf.engine_of(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {u.param_flat.untyped_storage().data_ptr() for u in engine.units}
    meter = SavedTensorMeter(params)
    trim()
    rss0 = rss_bytes()
    host0 = engine.ledger.live_bytes(Tier.HOST, "activation_offload")
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        loss = model(x, y)
    rss1 = rss_bytes()
    device_bytes, storages = meter.live_bytes()
    host_bytes = engine.ledger.live_bytes(Tier.HOST, "activation_offload") - host0
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    run["measured"] = {
        "activation_device_bytes": device_bytes,
        "activation_host_bytes": host_bytes,
        "saved_storages": storages,
        "saved_tensors_seen_by_outer_hook": meter.packed,
        "rss_delta_end_of_forward_bytes": rss1 - rss0,
        "host_bytes_after_backward": engine.ledger.live_bytes(Tier.HOST, "activation_offload"),
    }
    run["losses"].append(loss.item())


def timed_step(run: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    model, opt = run["model"], run["opt"]
    t0 = time.perf_counter()
    loss = model(x, y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    run["times_s"].append(time.perf_counter() - t0)
    run["losses"].append(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (median over these)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1 (the first warm-up round is the measured one)")
    torch.set_num_threads(args.threads)
    gpt_cfg = GPTConfig(seq_len=args.seq, n_layer=args.layers, n_head=args.heads, d_model=args.d_model)
    runs = [build(name, args, gpt_cfg) for name in SETTINGS]
    for rnd in range(args.warmup + args.steps):
        x, y = batch(rnd, args, gpt_cfg.vocab_size)
        for run in runs:
            if rnd == 0:
                measured_step(run, x, y)
            elif rnd < args.warmup:
                timed_step(run, x, y)
                run["times_s"].clear()
            else:
                timed_step(run, x, y)
    element = torch.finfo(zeroinf.Config(param_dtype=args.dtype).param_torch_dtype).bits // 8
    base_bytes = runs[0]["measured"]["activation_device_bytes"]
    base_time = statistics.median(runs[0]["times_s"])
    results = {}
    for run in runs:
        median = statistics.median(run["times_s"])
        m = run["measured"]
        results[run["name"]] = {
            "activation_device_bytes": m["activation_device_bytes"],
            "activation_host_bytes": m["activation_host_bytes"],
            "step_time_median_s": round(median, 4),
            "ratio_vs_no_ckpt": {
                "activation_device_bytes": round(m["activation_device_bytes"] / base_bytes, 4),
                "step_time": round(median / base_time, 3),
            },
            "step_times_s": [round(t, 4) for t in run["times_s"]],
            "rss_delta_end_of_forward_bytes": m["rss_delta_end_of_forward_bytes"],
            "saved_storages": m["saved_storages"],
            "saved_tensors_seen_by_outer_hook": m["saved_tensors_seen_by_outer_hook"],
            "host_bytes_after_backward": m["host_bytes_after_backward"],
        }
    # every setting computes the same function from the same weights and batches
    same_losses = all(
        max(abs(a - b) / abs(b) for a, b in zip(run["losses"], runs[0]["losses"], strict=True)) < 1e-4
        for run in runs
    )
    print(
        json.dumps(
            {
                "settings": {
                    "model": {
                        "n_layer": gpt_cfg.n_layer, "d_model": gpt_cfg.d_model, "n_head": gpt_cfg.n_head,
                        "d_ff": gpt_cfg.d_ff, "vocab_size": gpt_cfg.vocab_size, "params": gpt_cfg.param_count,
                    },
                    "batch": args.batch, "seq": args.seq, "stage": args.stage, "world_size": 1,
                    "dtype": args.dtype, "device": "cpu", "threads": args.threads,
                    "warmup_rounds": args.warmup, "timed_rounds": args.steps,
                    "order": "interleaved per round",
                    "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.machine(),
                },
                "checkpoint_inputs_bytes_computed": (
                    args.layers * args.batch * args.seq * args.d_model * element
                ),
                "losses_equal_across_settings": same_losses,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
