"""One rank of a short stage-3 training run, launched as a real process by tests/_launch.py.

    python tests/_rank_script.py PLACEMENT NVME_DIR [--steps N] [--timeout S]
                                 [--stop-rank R --stop-step K --signal KILL|STOP]

It never calls `engine_of(model).close()` nor `opt.close()`: the process must still end cleanly
(tests/test_clean_exit.py). With --stop-rank, rank R sends itself SIGKILL (or SIGSTOP) in the
middle of step K's forward, and the other ranks must fail within the collective timeout
(tests/test_faults.py). Prints one JSON line per rank on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

import zeroinf  # before the process group exists: see [Note: a process group that outlives destroy_process_group]
from zeroinf.models.gpt import GPT, GPTConfig

PLACEMENTS = {
    "memory": {},
    "host": {"optimizer": "host"},
    "nvme": {"params": "nvme", "optimizer": "nvme"},
    "all-nvme": {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"},
}


def gloo_threads() -> int:
    """Threads of a live gloo process group in this process (its workers and its socket loop)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += "gloo" in f.read()
        except OSError:
            pass
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("placement", choices=sorted(PLACEMENTS))
    parser.add_argument("nvme_dir")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=1)
    parser.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    args = parser.parse_args()

    tiers = PLACEMENTS[args.placement]
    offload = zeroinf.OffloadConfig(**tiers, nvme_dir=args.nvme_dir) if tiers else zeroinf.OffloadConfig()
    cfg = zeroinf.Config(stage=3, offload=offload, persist_threshold_bytes=0, collective_timeout_s=args.timeout)
    topo = zeroinf.init_distributed(timeout_s=cfg.collective_timeout_s)
    torch.manual_seed(0)
    model = zeroinf.shard(GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)), cfg)
    opt = zeroinf.AdamW(model, lr=1e-3)
    step = 0
    if topo.rank == args.stop_rank:

        def stop_mid_step(*_: object) -> None:
            if step == args.stop_step:
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))

        model.blocks[1].register_forward_pre_hook(stop_mid_step)
    losses = []
    for step in range(args.steps):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = model(x, x)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dist.destroy_process_group()
    print(json.dumps({"rank": topo.rank, "losses": losses, "gloo_threads_after_destroy": gloo_threads()}), flush=True)
    # No close() of the engine or the optimizer: interpreter exit must finish everything.


if __name__ == "__main__":
    main()
