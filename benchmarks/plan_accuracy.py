"""Predicted vs measured: `zeroinf.plan`'s bytes per tier, peak RSS and step time against real runs.

    zeroinf plan --measure --world 2 --nvme-dir /tmp      # once: this machine's profile (cached)
    python benchmarks/plan_accuracy.py --nvme-dir /tmp --out plan_accuracy.json

For each model size x placement x world size, a fresh set of processes (gloo ranks on the CPU, each
with `--threads` threads) builds the demo GPT under `zeroinf.init`, trains `--steps` steps on random
tokens and reports: the ledger's peak bytes per tier over the last step (`memory_report()["last_step"]`),
the process's peak RSS (VmHWM) and the median step time after the first (warm-up) step. The plan
for the same Config, world size, tokens and threads is computed from the cached machine profile
(`zeroinf plan --measure`; defaults otherwise, and the JSON says so).

Placements (the acceptance cases of issue 13): stage 3 in memory; the optimizer states on NVMe;
parameters and optimizer states on NVMe. Per (model, world) setting the planner's pick among them
(`auto`) is compared with the measured fastest. Placements run alternately, `--rounds` times, so
that all see the same background load; the medians over rounds are compared.

The JSON holds every figure, the relative errors (predicted / measured - 1) and a summary: the
largest byte error per tier, the share of cases within 10% (bytes) and 30% (time), and how often
auto picked the measured fastest (or one within 10% of it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODELS: dict[str, dict[str, int]] = {
    "small": {"n_layer": 4, "n_head": 4, "d_model": 256},  # 3.3M parameters
    "medium": {"n_layer": 8, "n_head": 8, "d_model": 512},  # 25M
    "large": {"n_layer": 12, "n_head": 12, "d_model": 768},  # 85M
}
PLACEMENTS: dict[str, dict[str, str]] = {
    "in memory": {"params": "device", "optimizer": "device", "gradients": "device"},
    "optimizer on nvme": {"params": "device", "optimizer": "nvme", "gradients": "device"},
    "params + optimizer on nvme": {"params": "nvme", "optimizer": "nvme", "gradients": "device"},
}


def gpt_config(model: str, seq_len: int) -> Any:
    from zeroinf.models.gpt import GPTConfig

    return GPTConfig(seq_len=seq_len, **MODELS[model])


def engine_config(placement: str, nvme_dir: str, dtype: str) -> Any:
    import zeroinf

    return zeroinf.Config(
        stage=3, param_dtype=dtype, offload=zeroinf.OffloadConfig(**PLACEMENTS[placement], nvme_dir=nvme_dir)
    )


# -- one case: ranks in fresh processes ------------------------------------------------------------------
def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank_main(rank: int, world: int, store: str, case: dict[str, Any], results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        import torch

        torch.set_num_threads(case["threads"])
        import torch.distributed as dist

        import zeroinf
        from zeroinf.models.gpt import GPT
        from zeroinf.topology import Topology

        if world > 1:
            dist.init_process_group(
                "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=600),
            )
        topo = Topology.current()
        folder = os.path.join(case["nvme_dir"], f"case-{os.getppid()}")
        os.makedirs(folder, exist_ok=True)
        cfg = engine_config(case["placement"], folder, case["dtype"])
        gpt = gpt_config(case["model"], case["seq_len"])
        torch.manual_seed(0)
        with zeroinf.init(cfg, topology=topo):
            model = GPT(gpt)
        zeroinf.shard(model, cfg, topology=topo)
        opt = zeroinf.AdamW(model, lr=1e-4)
        gen = torch.Generator().manual_seed(rank)
        step_s = []
        for _ in range(case["steps"]):
            data = torch.randint(0, gpt.vocab_size, (case["batch"], gpt.seq_len + 1), generator=gen)
            t0 = time.perf_counter()
            loss = model(data[:, :-1], data[:, 1:])
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            step_s.append(time.perf_counter() - t0)
        report = zeroinf.memory_report(model)
        last = report["last_step"]
        out = {
            "step_s": step_s,
            "ledger_peak": {t: last[t]["peak_bytes"] for t in ("device", "host", "nvme")},
            "peak_rss_bytes": _peak_rss(),
            "io": report["io"],
        }
        opt.close()
        zeroinf.engine_of(model).close()
        if world > 1:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def run_case(case: dict[str, Any], world: int, timeout_s: float = 1800) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zeroinf-plan-acc-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store, case, results)) for r in range(world)]
        for p in procs:
            p.start()
        outs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outs) < world:
                try:
                    rank, status, payload = results.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"case {case} failed (exit codes {[p.exitcode for p in procs]})") from None
                    continue
                if status == "error":
                    raise RuntimeError(f"case {case}, rank {rank}:\n{payload}")
                outs[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [outs[r] for r in range(world)]


# -- predictions -----------------------------------------------------------------------------------------
def predict(model: str, placement: str, world: int, args: argparse.Namespace, profile: Any) -> Any:
    from zeroinf.planner.api import plan
    from zeroinf.planner.model_facts import from_gpt_config

    cfg = engine_config(placement, args.nvme_dir, args.dtype)
    result = plan(
        from_gpt_config(gpt_config(model, args.seq_len)), cfg, world_size=world,
        tokens_per_step=args.batch * args.seq_len * world, seq_len=args.seq_len, profile=profile,
        threads=args.threads,
    )
    return result.estimates[0]


def rel(predicted: float, measured: float) -> float | None:
    return None if not measured else predicted / measured - 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every placement, alternating")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--nvme-dir", default=tempfile.gettempdir())
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()

    from zeroinf.planner.profile import cpu_name, load_profile, native_bf16

    profile = load_profile()
    cases = []
    for model in args.models:
        for world in args.worlds:
            measured: dict[str, list[dict[str, Any]]] = {p: [] for p in args.placements}
            for _ in range(args.rounds):
                for placement in args.placements:
                    case = {
                        "model": model, "placement": placement, "threads": args.threads, "steps": args.steps,
                        "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "nvme_dir": args.nvme_dir,
                    }
                    print(f"{model} world {world}: {placement} ...", file=sys.stderr, flush=True)
                    measured[placement].append(run_case(case, world)[0])
            for placement in args.placements:
                runs = measured[placement]
                step = statistics.median(statistics.median(r["step_s"][1:] or r["step_s"]) for r in runs)
                e = predict(model, placement, world, args, profile)
                ledger = runs[-1]["ledger_peak"]
                rss = max(r["peak_rss_bytes"] for r in runs)
                cases.append({
                    "model": model, "params": gpt_config(model, args.seq_len).param_count, "world": world,
                    "placement": placement,
                    "measured": {"ledger_peak": ledger, "peak_rss_bytes": rss, "step_s": step,
                                 "step_s_runs": [r["step_s"] for r in runs], "io": runs[-1]["io"]},
                    "predicted": {
                        "ledger_peak": {t: e.ledger.of(t) for t in ("device", "host", "nvme")},
                        "peak_rss_bytes": e.ram_bytes, "step_s": e.time.step_s, "time": dataclasses.asdict(e.time),
                    },
                    "error": {
                        "ledger": {t: rel(e.ledger.of(t), ledger[t]) for t in ("device", "host", "nvme")},
                        "peak_rss": rel(e.ram_bytes, rss),
                        "step_s": rel(e.time.step_s, step),
                    },
                })
    settings = []
    for model in args.models:
        for world in args.worlds:
            group = [c for c in cases if c["model"] == model and c["world"] == world]
            if len(group) < 2:
                continue
            fastest = min(group, key=lambda c: c["measured"]["step_s"])
            picked = min(group, key=lambda c: c["predicted"]["step_s"])
            ratio = picked["measured"]["step_s"] / fastest["measured"]["step_s"]
            settings.append({
                "model": model, "world": world, "auto_pick": picked["placement"],
                "measured_fastest": fastest["placement"],
                "pick_vs_fastest": ratio, "ok": ratio <= 1.10,
            })
    byte_errors = [abs(v) for c in cases for v in c["error"]["ledger"].values() if v is not None]
    time_errors = [abs(c["error"]["step_s"]) for c in cases if c["error"]["step_s"] is not None]
    rss_errors = [abs(c["error"]["peak_rss"]) for c in cases if c["error"]["peak_rss"] is not None]
    out = {
        "machine": {"cpu": cpu_name(), "native_bf16": native_bf16("cpu"), "cores": os.cpu_count(),
                    "profile": profile.source, "threads_per_rank": args.threads},
        "args": vars(args),
        "cases": cases,
        "auto": settings,
        "summary": {
            "cases": len(cases),
            "ledger_max_abs_error": max(byte_errors, default=None),
            "ledger_within_10pct": sum(e <= 0.10 for e in byte_errors) / max(1, len(byte_errors)),
            "peak_rss_max_abs_error": max(rss_errors, default=None),
            "peak_rss_within_10pct": sum(e <= 0.10 for e in rss_errors) / max(1, len(rss_errors)),
            "step_time_max_abs_error": max(time_errors, default=None),
            "step_time_within_30pct": sum(e <= 0.30 for e in time_errors) / max(1, len(time_errors)),
            "auto_ok": f"{sum(s['ok'] for s in settings)} of {len(settings)}",
        },
    }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
