"""One training step, then a second, of a demo GPT whose model states (16 bytes per parameter) are
larger than this machine's RAM: ~2B parameters, fully offloaded to NVMe, built under zeroinf.init.
Prints JSON with the parameter count, peak RSS, build time and step times. Needs ~40 GB free disk.

    python benchmarks/scale.py --nvme-dir /tmp/zi-scale [--n-layer 40 --d-model 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from _bench import offloaded_run  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--n-layer", type=int, default=40)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    folder = args.nvme_dir or tempfile.mkdtemp(prefix="zeroinf-scale-", dir="/tmp")
    os.makedirs(folder, exist_ok=True)
    out = offloaded_run(args.n_layer, args.d_model, args.seq_len, args.batch, 2, folder)
    out["model_state_bytes_at_16B_per_param"] = 16 * out["params"]
    out["machine_ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
