"""What a checkpoint costs the training loop: a step with no save, with a blocking save right after
it, and with a background save (`zeroinf.save(..., blocking=False)`) that the next step overlaps.

    python benchmarks/checkpoint_overlap.py --dir /mnt/nvme/ckpt [--n-layer 12 --d-model 768] [--repeats 3]

The demo GPT (bf16, stage 2, world 1) alternates the three modes on the same model, `--repeats`
times after one warm-up round. Times are for "step + save" as the training loop sees them: for the
background mode, the call to save plus the following step (whose `opt.step()` waits for the writes
and publishes the checkpoint). Prints one JSON object with the medians and the checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from _bench import build, close, machine, median, train_step  # noqa: E402

import zeroinf  # noqa: E402
import zeroinf.checkpoint as ck  # noqa: E402
from zeroinf.models.gpt import GPTConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary folder under /tmp)")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    folder = args.dir or tempfile.mkdtemp(prefix="zeroinf-ckpt-overlap-", dir="/tmp")
    gpt = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.d_model // 64, d_model=args.d_model)
    run = build(gpt, zeroinf.Config(stage=2, param_dtype="bf16"), args.batch)
    times: dict[str, list[float]] = {"no_save": [], "blocking_save": [], "background_save": []}
    step, nbytes = 0, 0
    for r in range(1 + args.repeats):
        for mode in times:
            root = os.path.join(folder, mode)
            t0 = time.perf_counter()
            if mode == "background_save":
                ck.save(root, run.model, run.opt, step=step, blocking=False)
            train_step(run, step)  # a background save is finished by this step's opt.step()
            if mode == "blocking_save":
                ck.save(root, run.model, run.opt, step=step)
            seconds = time.perf_counter() - t0
            if r > 0:
                times[mode].append(seconds)
            if mode != "no_save":
                path = os.path.join(root, f"step_{step:08d}")
                nbytes = sum(e.stat().st_size for e in os.scandir(path))
                shutil.rmtree(root)
            step += 1
    close(run)
    medians = {k: median(v) for k, v in times.items()}
    print(json.dumps({
        "model_params": gpt.param_count, "checkpoint_bytes": nbytes, "step_s": times, "median_s": medians,
        "blocking_save_cost_s": medians["blocking_save"] - medians["no_save"],
        "background_save_cost_s": medians["background_save"] - medians["no_save"],
        "machine": machine(),
    }, indent=1))
    if args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
