"""The largest Hugging Face Llama this machine trains (full fine-tune: AdamW, fp32 master weights).

    python benchmarks/largest.py --nvme-dir /tmp/zi-largest [--dtype fp32] [--seq-len 32] [--plan-only]
        [--moment-dtype bf16]   # Adam's moments in bf16 (offload.moment_dtype): 8 bytes of states per parameter
    # a GPU machine: parameters on the device, optimizer states on the host, or split host/NVMe
    python benchmarks/largest.py --nvme-dir D --dtype bf16 --seq-len 2048 --batch 4 \
        --placements opt-host,opt-split --shapes 4096x44,4096x58

1. By plan: a ladder of Llama shapes (Llama-7B's width, 4096, with a growing number of layers, then
   Llama-13B's, 5120) is estimated by `zeroinf.plan` (built on the meta device from a config.json,
   no weights) in two placements, both stage 3 with the parameters on NVMe: the optimizer states on
   the host within a budget of `--host-share` of the available RAM with the rest on NVMe (the split,
   `offload.max_host_bytes`), and everything on NVMe. The largest shape with a placement that fits
   (RAM, disk in the NVMe folder, device memory) is the candidate.
2. Confirmed by two steps: the candidate is built under `zeroinf.init` in a fresh process and trained
   two steps on random tokens; if that fails (out of memory, out of disk), the next smaller shape is
   tried. The child reports seconds per step, peak RSS (VmHWM), peak device memory, the NVMe bytes
   the engine held and the folder's disk use at its fullest, and the losses.
Prints one JSON object: the machine, every planned shape, and the confirmed one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from _bench import machine, peak_rss_bytes  # noqa: E402

WIDTHS = {4096: (11008, 32, 32), 5120: (13824, 40, 40)}  # hidden: (intermediate, heads, kv heads), as Llama 1/2
VOCAB = 32000
PLACEMENTS = ("split", "nvme", "opt-host", "opt-split")  # the configs `configs` builds, by name


def llama_config(hidden: int, layers: int) -> dict:
    intermediate, heads, kv_heads = WIDTHS[hidden]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def ladder(shapes: str | None = None) -> list[tuple[int, int]]:
    """Llama shapes (hidden, layers), smallest first: `--shapes 4096x44,4096x58` or the default ladder."""
    if shapes:
        return [(int(h), int(n)) for h, n in (s.split("x") for s in shapes.split(","))]
    return [(4096, layers) for layers in range(8, 61, 2)] + [(5120, layers) for layers in range(40, 61, 4)]


def configs(args: argparse.Namespace, host_budget: int) -> dict:
    """The placements tried, by name (`--placements`). On this CPU machine the parameters go to NVMe
    too (device and host are one RAM); on a GPU machine they stay on the device, sharded:
    `opt-host` keeps the optimizer states on the host alone, `opt-split` puts what exceeds the host
    budget on NVMe (the largest-model issue's two GPU goals)."""
    import zeroinf

    common = dict(stage=3, param_dtype=args.dtype, persist_threshold_bytes=0)
    moments = args.moment_dtype
    every = {
        "split": zeroinf.Config(**common, offload=zeroinf.OffloadConfig(
            params="nvme", optimizer="host", nvme_dir=args.nvme_dir, max_host_bytes=host_budget, moment_dtype=moments)),
        "nvme": zeroinf.Config(**common, offload=zeroinf.OffloadConfig(
            params="nvme", optimizer="nvme", nvme_dir=args.nvme_dir, moment_dtype=moments)),
        "opt-host": zeroinf.Config(**common, offload=zeroinf.OffloadConfig(
            optimizer="host", gradients="host", moment_dtype=moments)),
        "opt-split": zeroinf.Config(**common, offload=zeroinf.OffloadConfig(
            optimizer="host", gradients="host", nvme_dir=args.nvme_dir, max_host_bytes=host_budget,
            moment_dtype=moments)),
    }
    return {name: every[name] for name in args.placements.split(",")}


def plan_shapes(args: argparse.Namespace) -> tuple[list[dict], int]:
    import zeroinf
    from zeroinf.planner.profile import available_ram_bytes

    host_budget = int(args.host_share * available_ram_bytes())
    rows = []
    folder = tempfile.mkdtemp(prefix="zeroinf-largest-config-")
    for hidden, layers in ladder(args.shapes):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(llama_config(hidden, layers), f)
        row: dict = {"hidden": hidden, "layers": layers, "placements": {}}
        for name, cfg in configs(args, host_budget).items():
            plan = zeroinf.plan(folder, cfg, tokens_per_step=args.batch * args.seq_len, seq_len=args.seq_len,
                                nvme_dir=args.nvme_dir)
            e = plan.estimates[0]
            row["params"] = plan.param_count
            row["placements"][name] = {
                "fits": e.fits, "why_not": list(e.why_not), "predicted_step_s": e.time.step_s,
                "ram_bytes": e.ram_bytes, "nvme_bytes": e.ledger.nvme, "device_bytes": e.device_bytes,
                "optimizer_split": e.optimizer_split.to_json() if e.optimizer_split is not None else None,
            }
        fitting = [n for n, p in row["placements"].items() if p["fits"]]
        row["placement"] = min(fitting, key=lambda n: row["placements"][n]["predicted_step_s"]) if fitting else None
        rows.append(row)
        print(f"plan: {row['params'] / 1e9:.2f}B ({hidden} x {layers}): {row['placement'] or 'does not fit'}",
              file=sys.stderr, flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return rows, host_budget


def disk_used(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def child(args: argparse.Namespace) -> dict:
    """Build the shape under zeroinf.init and train `--steps` steps (in its own process)."""
    import threading

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroinf

    spec = json.loads(args.child)
    cfg = configs(args, spec["host_budget"])[spec["placement"]]
    os.makedirs(args.nvme_dir, exist_ok=True)
    fullest = [0]
    stop = threading.Event()

    def watch_disk() -> None:  # the folder's allocated bytes at their fullest
        while not stop.wait(2.0):
            fullest[0] = max(fullest[0], disk_used(args.nvme_dir))

    threading.Thread(target=watch_disk, daemon=True).start()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zeroinf.init(cfg):
        model = LlamaForCausalLM(LlamaConfig(**llama_config(spec["hidden"], spec["layers"])))
    zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=1e-5)
    build_s = time.perf_counter() - t0
    device = zeroinf.engine_of(model).topo.device
    step_s, losses = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=g).to(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        print(f"step {step}: {step_s[-1]:.1f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    report = zeroinf.memory_report(model)
    stop.set()
    fullest[0] = max(fullest[0], disk_used(args.nvme_dir))
    out = {
        "params": sum(u.layout.numel for u in zeroinf.engine_of(model).all_units),
        "build_s": build_s, "step_s": step_s, "losses": losses, "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "ledger_peak_bytes": {t: report[t]["peak_bytes"] for t in ("device", "host", "nvme")},
        "disk_used_peak_bytes": fullest[0],
        "optimizer_split": s.to_json() if (s := getattr(opt.states, "split", None)) is not None else None,
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-dir", required=True)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--moment-dtype", default="fp32", choices=["fp32", "bf16"], help="offload.moment_dtype")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--host-share", type=float, default=0.7, help="share of available RAM for optimizer states")
    parser.add_argument("--plan-only", action="store_true")
    parser.add_argument("--placements", default="split,nvme",
                        help="split,nvme (parameters on NVMe: a CPU machine); opt-host,opt-split on a GPU machine")
    parser.add_argument("--shapes", default=None, help="hidden x layers, comma-separated (default: the ladder)")
    parser.add_argument("--try-unplanned", action="store_true",
                        help="also confirm shapes the plan says do not fit (its verdict stays in the JSON)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = [name for name in args.placements.split(",") if name not in PLACEMENTS]
    if unknown:
        parser.error(f"--placements {','.join(unknown)}: unknown; choose from {','.join(PLACEMENTS)}")
    if args.child:
        print(json.dumps(child(args)))
        return
    rows, host_budget = plan_shapes(args)
    out: dict = {"machine": machine(), "command": " ".join(sys.argv), "host_budget_bytes": host_budget,
                 "planned": rows, "confirmed": None, "failed": []}
    if args.try_unplanned:  # confirm every listed shape, the plan's verdict recorded beside it
        for r in rows:
            r["placement"] = r["placement"] or min(r["placements"], key=lambda n: r["placements"][n]["ram_bytes"])
    fitting = [r for r in rows if r["placement"] is not None]
    for row in ([] if args.plan_only else sorted(fitting, key=lambda r: -r["params"])):
        spec = {"hidden": row["hidden"], "layers": row["layers"], "placement": row["placement"],
                "host_budget": host_budget}
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        print(f"confirming {row['params'] / 1e9:.2f}B in {row['placement']}", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", json.dumps(spec)],
                              stdout=subprocess.PIPE, text=True, check=False)
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        if proc.returncode == 0:
            out["confirmed"] = {**spec, "shape": llama_config(row["hidden"], row["layers"]),
                                **json.loads(proc.stdout.strip().splitlines()[-1])}
            break
        out["failed"].append({**spec, "exit": proc.returncode})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
