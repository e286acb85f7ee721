"""Soak: the demo fully offloaded for many steps with periodic checkpoints, then a resume.

    python benchmarks/soak.py [--steps 1000] [--save-every 100] [--resume-from 500] [--dir D]

Run A: `zeroinf train --model tiny`, stage 3, parameters, gradients and optimizer states on NVMe
(`persist_threshold_bytes = 0`, so every unit's parameters really live there), a background
checkpoint every `--save-every` steps. This wrapper polls the process's VmRSS and the swap
folder's allocated bytes every `--interval` seconds. Steps are placed on the time axis by the
report's step times, anchored where `latest` moves to step_{save-every} (during the step after
it). Run B resumes from A's checkpoint at `--resume-from` and trains to the end in the same swap
folder. Prints one JSON object: RSS and swap bytes at the first sample after step 50 and their
largest value after it (growth in %), and whether B's losses equal A's bitwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def allocated_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*") if folder.exists() else ():
        try:
            total += path.lstat().st_blocks * 512
        except OSError:
            pass
    return total


def latest(root: Path) -> str | None:
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return None


def train(args: argparse.Namespace, folder: Path, name: str, extra: list[str]) -> tuple[dict, list[dict]]:
    """Run `zeroinf train`, sampling it; returns its report and the samples (time, rss, swap, latest)."""
    config = folder / "soak.toml"
    config.write_text("stage = 3\nparam_dtype = \"bf16\"\ngrad_clip_norm = 1.0\npersist_threshold_bytes = 0\n")
    report = folder / f"{name}.json"
    command = [
        sys.executable, "-m", "zeroinf", "train", "--model", "tiny", "--steps", str(args.steps),
        "--config", str(config), "--offload-params", "nvme", "--offload-optimizer", "nvme",
        "--offload-gradients", "nvme", "--nvme-dir", str(folder / "swap"), "--save-dir", str(folder / "ckpt"),
        "--save-every", str(args.save_every), "--eval-batches", "0", "--no-progress", "--report", str(report),
        *extra,
    ]
    proc = subprocess.Popen(command)
    samples = []
    while proc.poll() is None:
        rss = rss_bytes(proc.pid)
        if rss is not None:
            swap = allocated_bytes(folder / "swap")
            samples.append({"t": time.monotonic(), "rss": rss, "swap": swap, "latest": latest(folder / "ckpt")})
        time.sleep(args.interval)
    end = time.monotonic()
    if proc.returncode != 0:
        raise SystemExit(f"soak: run {name} failed with exit code {proc.returncode}")
    result = json.loads(report.read_text())
    result["_end"] = end
    return result, samples


def step_of_samples(report: dict, samples: list[dict], save_every: int) -> list[tuple[int, dict]]:
    """(step being trained, sample) for every sample, from the step times and one anchor."""
    times, start = report["step_times_s"], report["start_step"]
    first_save = f"step_{start + save_every:08d}" if start == 0 else None
    anchor = next((s for s in samples if first_save and s["latest"] == first_save), None)
    ends: list[float] = []
    if anchor is not None:  # `latest` moves inside the step after the save: that step began before it
        begin = anchor["t"] - sum(times[: save_every])
    else:  # a resumed run: anchor on the end of the process (evaluation is off, closing is short)
        begin = report["_end"] - sum(times)
    t = begin
    for dt in times:
        t += dt
        ends.append(t)
    out = []
    for s in samples:
        step = start + next((i for i, e in enumerate(ends) if s["t"] <= e), len(ends))
        out.append((step, s))
    return out


def growth(stepped: list[tuple[int, dict]], key: str, after_step: int, end_step: int) -> dict:
    """The sampled `key` from step `after_step` until training ends (not the shutdown after it)."""
    values = [s[key] for step, s in stepped if after_step <= step < end_step]
    if not values:
        return {}
    base = values[0]
    return {
        f"{key}_at_step_{after_step}_bytes": base,
        f"{key}_max_after_bytes": max(values),
        f"{key}_last_bytes": values[-1],
        f"{key}_growth_pct": round(100.0 * (max(values) - base) / base, 2) if base else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--resume-from", type=int, default=500)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary folder under /tmp)")
    args = ap.parse_args(argv)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="zeroinf-soak-", dir="/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    a, samples = train(args, folder, "straight", [])
    stepped = step_of_samples(a, samples, args.save_every)
    resume_dir = folder / "ckpt" / f"step_{args.resume_from:08d}"
    b, b_samples = train(args, folder, "resumed", ["--resume", str(resume_dir)])
    tail = a["losses"][args.resume_from :]
    out = {
        "steps": args.steps,
        "save_every": args.save_every,
        "samples": len(samples),
        "wall_s": round(time.monotonic() - t0, 1),
        "straight_wall_s": round(a["wall_time_s"], 1),
        "median_step_s": sorted(a["step_times_s"])[len(a["step_times_s"]) // 2],
        **growth(stepped, "rss", 50, args.steps),
        **growth(stepped, "swap", 50, args.steps),
        "rss_first_sample_bytes": samples[0]["rss"] if samples else None,
        "checkpoints": sorted(p.name for p in (folder / "ckpt").iterdir() if p.name.startswith("step_")),
        "resumed_from": args.resume_from,
        "resumed_steps": len(b["losses"]),
        "resumed_losses_bitwise_equal": b["losses"] == tail,
        "resumed_max_abs_diff": max((abs(x - y) for x, y in zip(b["losses"], tail, strict=False)), default=None),
        "resumed_rss_max_bytes": max((s["rss"] for s in b_samples), default=None),
        "swap_files_left": sorted(p.name for p in (folder / "swap").iterdir()) if (folder / "swap").exists() else [],
        "folder": str(folder),
    }
    print(json.dumps(out, indent=2))
    return 0 if out["resumed_losses_bitwise_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
