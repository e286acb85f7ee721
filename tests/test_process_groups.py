"""A model sharded over a process group that is not the world (`Topology.current(group)`): four ranks
split into two groups of two, each group training its own copy side by side. Every rank-addressed
collective must name the group's ranks, not the world's: the group {2, 3} has no global rank 0 to
broadcast from, and its first rank's swap files must not collide with those of the group {0, 1} in
a shared NVMe folder. Each group also saves a checkpoint of its own and loads it into a model built
afresh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import run_ranks
from tests._parity import GLOBAL_BATCH, LR, build_model, global_batch

STEPS = 3


class WithBuffers(nn.Module):
    """The parity transformer beside a buffer and a frozen layer, both drawn by this rank's seed."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = build_model("tiny_gpt", seed=int(torch.initial_seed()))
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.register_buffer("projection", torch.randn(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gpt(x, y) + 0.0 * (self.frozen(self.projection)).sum()


def _build(seed: int) -> WithBuffers:
    torch.manual_seed(seed)
    return WithBuffers()


def _mean(value: torch.Tensor, group: dist.ProcessGroup) -> float:
    dist.all_reduce(value, group=group)
    return (value / 2).item()


def _train_in_two_groups(rank: int, world: int, folder: str) -> dict:
    import zeroinf

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in order
    group = groups[rank // 2]
    with pytest.raises(ValueError, match=f"global rank {rank} is not a member of the process group"):
        zeroinf.Topology.current(groups[1 - rank // 2])
    topo = zeroinf.Topology.current(group)
    assert topo.rank == rank % 2 and topo.world_size == 2

    # The group's second rank builds other weights and buffers: its first rank's win, as in DDP.
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="host", nvme_dir=folder)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)  # every unit's shard on NVMe
    model = zeroinf.shard(_build(seed=topo.rank), cfg, topo)
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    per_rank = GLOBAL_BATCH // 2
    losses = []
    for step in range(STEPS):
        x, y = (t[topo.rank * per_rank : (topo.rank + 1) * per_rank] for t in global_batch(step))
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss.detach(), group))
    trained = {n: t.clone() for n, t in model.state_dict().items()}

    # A checkpoint per group, written and read by the group's ranks only, into a model built afresh.
    ckpt = str(Path(folder) / f"ckpt-group{rank // 2}")
    zeroinf.save(ckpt, model, opt, step=STEPS)
    fresh = zeroinf.shard(_build(seed=100 + rank), cfg, topo)
    fresh_opt = zeroinf.AdamW(fresh, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    zeroinf.load(ckpt, fresh, fresh_opt)
    loaded = {n: t.clone() for n, t in fresh.state_dict().items()}
    fresh_opt.close()
    zeroinf.engine_of(fresh).close()

    # `modifier_rank` is a rank of the model's group: the group's second rank's values win.
    bias = model.gpt.ln_f.bias
    with zeroinf.gathered(bias, modify=True, modifier_rank=1):
        with torch.no_grad():
            bias.fill_(float(rank))
    with zeroinf.gathered(bias):
        written = bias.detach().clone()

    # Plain PyTorch's data parallelism over the same group, from the first rank's seed.
    reference = _build(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(reference, process_group=group)
    plain_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95), weight_decay=0.0,
        fused=True,
    )
    plain_losses = []
    for step in range(STEPS):
        x, y = (t[topo.rank * per_rank : (topo.rank + 1) * per_rank] for t in global_batch(step))
        loss = ddp(x, y)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        plain_losses.append(_mean(loss.detach(), group))
    swap_files = sorted(p.name for p in Path(folder).iterdir())
    return {
        "losses": losses, "plain_losses": plain_losses, "trained": trained, "loaded": loaded,
        "plain": {n: t.detach().clone() for n, t in reference.state_dict().items()},
        "written": written, "swap_files_while_training": swap_files,
    }


def test_two_groups_of_two_ranks_each_train_like_plain_data_parallelism(tmp_path: Path) -> None:
    out = run_ranks(_train_in_two_groups, 4, str(tmp_path), timeout_s=240)
    for rank, result in enumerate(out):
        assert result["losses"] == result["plain_losses"], rank  # bitwise: two addends, halved
        assert result["trained"].keys() == result["plain"].keys()
        for name, tensor in result["trained"].items():
            assert torch.equal(tensor, result["plain"][name]), (rank, name)
            assert torch.equal(result["loaded"][name], tensor), (rank, name)  # its group's checkpoint
        # the group's second rank (global rank 1 or 3) wrote the values every rank of its group reads
        assert torch.all(result["written"] == float(2 * (rank // 2) + 1)), rank
    assert out[0]["losses"] == out[2]["losses"]  # the two groups trained the same model on the same data
    # every process has its own swap files in the shared folder, named by its rank in the world
    for rank in range(4):
        assert any(f"zeroinf-rank{rank}-" in name for name in out[rank]["swap_files_while_training"]), rank
