"""Is host memory flat in model size when everything is offloaded? The demo GPT at ~150M and ~600M
parameters (same width, 4x the depth, so every unit and buffer has the same size), fully offloaded
to NVMe (stage 3, bf16: parameters, gradient shards and optimizer states), each built and trained
for two steps in its own process; prints the peak RSS of each and their ratio as JSON.

    python benchmarks/memory_flat.py --nvme-dir /tmp/zi-flat
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--layers", type=int, nargs=2, default=[12, 48], help="depths of the small and large model")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = args.nvme_dir or tempfile.mkdtemp(prefix="zeroinf-flat-", dir="/tmp")
    if args.child is not None:
        from _bench import offloaded_run

        folder = os.path.join(root, f"L{args.child}")
        os.makedirs(folder, exist_ok=True)
        print(json.dumps(offloaded_run(args.child, args.d_model, 256, 2, args.steps, folder)))
        return 0
    runs = []
    for n_layer in args.layers:
        cmd = [sys.executable, __file__, "--child", str(n_layer), "--nvme-dir", root,
               "--d-model", str(args.d_model), "--steps", str(args.steps)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    small, large = runs
    print(json.dumps({
        "runs": runs,
        "params_ratio": large["params"] / small["params"],
        "peak_rss_ratio": large["peak_rss_bytes"] / small["peak_rss_bytes"],
        "target": "peak_rss_ratio <= 1.15",
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
