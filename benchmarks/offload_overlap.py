"""How much does ZeRO-Infinity offload cost? The demo GPT (~300M parameters, bf16) trained
(a) with every state in memory and (b) with parameters and optimizer states on NVMe, alternating
a b a b in one process on the same seed and data, at several tokens per step.

    python benchmarks/offload_overlap.py --nvme-dir /tmp/zi-bench [--tokens 4096 16384] [--repeats 3]

Prints one JSON object: per token setting the step-time medians, the ratio (b)/(a), the bytes
moved per tier in a (b) step, the time (b) waited on I/O and the overlap (share of I/O time hidden
behind other work). Both runs checkpoint activations (16K tokens of a 24-block model would not
fit in this machine's RAM otherwise). World size 1: on two cores, two gloo ranks measure loopback
collectives, not offload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _bench import build, close, machine, median, peak_rss_bytes, train_step  # noqa: E402

import zeroinf  # noqa: E402
from zeroinf.models.gpt import GPTConfig  # noqa: E402


def io_counters(run) -> dict[str, float]:  # noqa: ANN001
    engine = zeroinf.engine_of(run.model)
    out: dict[str, float] = {}
    files = engine.param_files
    if files is not None:
        stats = files.engine.stats()
        out["param_read_bytes"] = stats.bytes_read
        out["param_written_bytes"] = stats.bytes_written
        out["param_io_wait_s"] = files.io_wait_s
        out["param_io_busy_s"] = files.io_busy_s
    states = getattr(run.opt, "states", None)
    traffic = getattr(states, "traffic", None)
    if traffic is not None:
        for k, v in traffic.total.items():
            out[f"optimizer_{k}"] = v
    pipeline = getattr(run.opt, "_pipeline", None)
    for name in ("io_wait_s", "io_busy_s"):
        if pipeline is not None and hasattr(pipeline, name):
            out[f"optimizer_{name}"] = getattr(pipeline, name)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-dir", default=None, help="swap folder (default: a temporary folder under /tmp)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    nvme_root = args.nvme_dir or tempfile.mkdtemp(prefix="zeroinf-overlap-", dir="/tmp")
    gpt = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.d_model // 64, d_model=args.d_model)
    common = dict(param_dtype="bf16", activation_checkpointing=True)
    result: dict[str, object] = {
        "model_params": gpt.param_count, "settings": {**common, "n_layer": args.n_layer, "d_model": args.d_model},
        "machine": machine(), "per_tokens": {},
    }
    for tokens in args.tokens:
        batch = max(1, tokens // args.seq_len)
        folder = os.path.join(nvme_root, f"t{tokens}")
        os.makedirs(folder, exist_ok=True)
        in_memory = build(gpt, zeroinf.Config(stage=2, **common), batch)
        offloaded = build(
            gpt,
            zeroinf.Config(
                stage=3, **common,
                offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder),
            ),
            batch,
        )
        times: dict[str, list[float]] = {"a": [], "b": []}
        losses: dict[str, list[float]] = {"a": [], "b": []}
        io = {}
        for step in range(args.warmup + args.repeats):
            for name, run in (("a", in_memory), ("b", offloaded)):
                before = io_counters(run) if name == "b" else {}
                seconds, loss = train_step(run, step)
                if step >= args.warmup:
                    times[name].append(seconds)
                    if name == "b":
                        io = delta(io_counters(run), before)
                losses[name].append(loss)
        a, b = median(times["a"]), median(times["b"])
        waited = io.get("param_io_wait_s", 0.0) + io.get("optimizer_io_wait_s", 0.0)
        busy = io.get("param_io_busy_s", 0.0) + io.get("optimizer_io_busy_s", 0.0)
        result["per_tokens"][str(tokens)] = {  # type: ignore[index]
            "batch": batch,
            "step_s_in_memory": times["a"], "step_s_offloaded": times["b"],
            "median_s_in_memory": a, "median_s_offloaded": b, "ratio_offloaded_vs_memory": b / a,
            "io_last_offloaded_step": io,
            "io_wait_s": waited, "io_busy_s": busy,
            "overlap_pct": 100.0 * (1 - waited / busy) if busy > 0 else None,
            "losses_in_memory": losses["a"], "losses_offloaded": losses["b"],
        }
        close(in_memory)
        close(offloaded)
        print(json.dumps({"tokens": tokens, "ratio": b / a, "a": a, "b": b}), file=sys.stderr, flush=True)
    result["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.time()
    rc = main()
    print(f"wall {time.time() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
