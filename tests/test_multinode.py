"""Two torchrun "nodes" on this host (c10d rendezvous on loopback, one rank each) train the demo to the
same losses as one node with the same world size; the command line's INFO lines come from rank 0
only (here the notice that every unit of the tiny model stays resident)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._launch import free_port, rank_env

TRAIN = [
    "-m", "zeroinf", "train", "--model", "tiny", "--steps", "4", "--batch", "4", "--seq-len", "32",
    "--eval-batches", "0", "--stage", "3", "--offload-params", "nvme", "--no-progress",
]
NOTICE = "units are resident"


def torchrun(launch: list[str], report: Path, cores: set[int]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, *TRAIN, "--report", str(report)],
        env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )


def node_cores() -> list[set[int]]:
    """Half of this machine's cores for each "node", so that its rank takes as many CPU threads
    (`zeroinf.train.set_cpu_threads`) as a rank of the one-node run: same threads, same sums."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return [set(cores[:half]), set(cores[half:] or cores[:half])]


def test_two_nodes_train_like_one_node(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    two = tmp_path / "two-nodes.json"
    nodes = [
        torchrun(
            ["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", "zeroinf-two-nodes"],
            two,
            cores,
        )
        for n, cores in enumerate(node_cores())
    ]
    one = tmp_path / "one-node.json"
    single = torchrun(["--standalone", "--nproc-per-node", "2"], one, os.sched_getaffinity(0))
    outputs = [p.communicate(timeout=300) for p in (*nodes, single)]
    for p, (_, err) in zip((*nodes, single), outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    two_nodes, one_node = json.loads(two.read_text()), json.loads(one.read_text())
    assert two_nodes["world_size"] == one_node["world_size"] == 2
    assert two_nodes["losses"] == one_node["losses"]  # bitwise: the same world, data and threads per rank
    node_logs = [err for _, err in outputs[:2]]
    assert sum(log.count(NOTICE) for log in node_logs) == 1, node_logs
    assert "[zeroinf rank 0] INFO" in "".join(node_logs)
    assert outputs[2][1].count(NOTICE) == 1
