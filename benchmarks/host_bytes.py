"""Host bytes per parameter with the optimizer on the host, and the host/NVMe split of the states.

    python benchmarks/host_bytes.py --nvme-dir /tmp/zi-hb [--n-layer 20 --d-model 2048] [--variants host,split,nvme]

Stage 3, world 1, fp32 (or --dtype), parameters on NVMe (on a CPU machine device and host are the same RAM, so
the parameters go to disk to isolate the optimizer's share), no clipping. Each variant runs in a
fresh process (peak RSS is a process's high-water mark):
- `host`: optimizer states on the host;
- `split`: optimizer on the host with `offload.max_host_bytes` set to two thirds of what the states
  need (they exceed the budget by half), the rest spilled to NVMe;
- `nvme`: optimizer states on NVMe.
`--reuse-step-memory true|false` overrides `Config.reuse_step_memory` ("auto" by default);
`--grad-pool off` allocates every gradient buffer afresh (partition/grad_pool.py), to compare;
`--split-root false` keeps the embeddings in the root unit (`Config.split_root`);
`--moment-dtype bf16` keeps Adam's moments in bf16 (`offload.moment_dtype`: 8 bytes of states per parameter).
Per variant: the RSS before the model is built (the baseline), the peak RSS (VmHWM, the same as
ru_maxrss) over build and steps, (peak - baseline) / parameters, the engine's host and device
ledger peaks per parameter, median seconds per step (first step dropped), the losses, and where
the optimizer states went. The parent checks the losses of every variant against `nvme`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from _bench import (  # noqa: E402
    add_step_memory_args,
    apply_grad_pool,
    build,
    close,
    machine,
    median,
    peak_rss_bytes,
    reuse_step_memory,
    rss_bytes,
    train_step,
)

import zeroinf  # noqa: E402
from zeroinf.models.gpt import GPTConfig  # noqa: E402

STATE_BYTES_PER_PARAM = 12  # fp32 master + two Adam moments
VARIANTS = ("host", "split", "nvme")  # optimizer states on the host, split by a budget, on NVMe


def child(a: argparse.Namespace) -> dict:
    gpt = GPTConfig(seq_len=a.seq_len, n_layer=a.n_layer, n_head=max(1, a.d_model // 64), d_model=a.d_model)
    folder = os.path.join(a.nvme_dir, a.child)
    os.makedirs(folder, exist_ok=True)
    optimizer = "nvme" if a.child == "nvme" else "host"
    budget = None
    if a.child == "split":
        per_param = STATE_BYTES_PER_PARAM if a.moment_dtype == "fp32" else STATE_BYTES_PER_PARAM - 4
        budget = int(per_param * gpt.param_count / 1.5)
    offload = zeroinf.OffloadConfig(
        params="nvme", optimizer=optimizer, nvme_dir=folder, max_host_bytes=budget, moment_dtype=a.moment_dtype
    )
    cfg = zeroinf.Config(
        stage=3, param_dtype=a.dtype, persist_threshold_bytes=0, offload=offload,
        reuse_step_memory=reuse_step_memory(a), split_root=a.split_root == "true",
    )
    baseline = rss_bytes()
    t0 = time.perf_counter()
    run = build(gpt, cfg, a.batch)
    build_s = time.perf_counter() - t0
    apply_grad_pool(run, a)
    build_peak = peak_rss_bytes()  # the model and the optimizer built: where the high-water mark was set
    seconds, losses, host_peaks, device_peaks, step_peaks, faults = [], [], [], [], [], []
    for step in range(a.steps):
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        took, loss = train_step(run, step)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        seconds.append(took)
        losses.append(loss)
        last = zeroinf.memory_report(run.model)["last_step"] or {}
        host_peaks.append(last.get("host", {}).get("peak_bytes", 0))
        device_peaks.append(last.get("device", {}).get("peak_bytes", 0))
        step_peaks.append(peak_rss_bytes())
    params = gpt.param_count
    peak = peak_rss_bytes()
    report = zeroinf.memory_report(run.model)
    split = getattr(run.opt.states, "split", None)  # a SplitStateStore's OptimizerSplit
    out = {
        "variant": a.child, "params": params, "max_host_bytes": budget, "build_s": build_s,
        "median_step_s": median(seconds[1:]), "step_s": seconds, "losses": losses,
        "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
        "rss_above_baseline_per_param": (peak - baseline) / params,
        "build_rss_above_baseline_per_param": (build_peak - baseline) / params,
        "rss_high_water_after_each_step": step_peaks,
        "minor_faults_each_step": faults,  # pages touched for the first time: buffers mapped afresh
        "ledger_host_peak_per_param": max(host_peaks) / params,
        "ledger_device_peak_per_param": max(device_peaks) / params,
        "ledger_host_by_tag": report["host"]["by_tag"],
        "optimizer_split": split.to_json() if split is not None else None,
    }
    close(run)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-dir", required=True)
    parser.add_argument("--n-layer", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", help="compute dtype of the parameters (fp32, bf16)")
    parser.add_argument("--variants", default="host,split,nvme")
    parser.add_argument("--split-root", default="true", choices=["true", "false"], help="Config.split_root")
    parser.add_argument("--moment-dtype", default="fp32", choices=["fp32", "bf16"], help="offload.moment_dtype")
    add_step_memory_args(parser)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    unknown = [name for name in a.variants.split(",") if name not in VARIANTS]
    if unknown:  # an unknown name would have run as "host"
        parser.error(f"--variants {','.join(unknown)}: unknown; choose from {','.join(VARIANTS)}")
    if a.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up, left out of median_step_s")
    if a.child:
        print(json.dumps(child(a)))
        return
    results = {}
    for name in a.variants.split(","):
        cmd = [sys.executable, __file__, "--child", name, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"variant {name} failed (exit {proc.returncode})")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {"machine": machine(), "command": " ".join(sys.argv), "variants": results}
    if "nvme" in results:
        ref = results["nvme"]["losses"]
        out["losses_equal_to_nvme"] = {n: r["losses"] == ref for n, r in results.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
