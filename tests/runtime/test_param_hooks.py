"""A loop's own hooks on the parameters of a sharded model.

Gradients never sit in `p.grad` (README, "Gradients never sit in `p.grad`"), but a tensor hook
registered on a parameter (`p.register_hook(fn)`: per-layer gradient logging, wandb's `watch`)
still receives that rank's whole local gradient of the parameter, before any reduction, as under
DDP: at stage 3 too, where the parameter outside its unit's forward is an empty placeholder. Checked
against the same hooks on plain PyTorch, bitwise: every parameter, stages 0-3, parameters and
optimizer states in memory and on NVMe, at world 1 and at world 2 (each rank's hooks see the
gradient of its own half of the batch; the first step bitwise, the second within 1e-4 after an
update from gradients summed in another order). A post-accumulate-grad hook runs after the engine's own has
taken the gradient: it sees `p.grad` None, as under DeepSpeed's ZeRO.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch


def _hooked(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    seen: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: seen.setdefault(name, []).append(g.detach().clone()))
    return seen


def _plain(world: int = 1) -> list[dict[str, list[torch.Tensor]]]:
    """The hooks' gradients of plain PyTorch over 2 steps, per rank: each global batch is cut into
    `world` slices, each slice's loss backpropagated on its own (what that rank's hooks see) and
    the gradients averaged for the step (what the ranks' reduction gives)."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    per_rank: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(world)]
    for step in range(2):
        x, y = global_batch(step)
        rows = x.shape[0] // world
        for rank in range(world):
            handles = [
                p.register_hook(lambda g, name=name, rank=rank: per_rank[rank].setdefault(name, []).append(g.clone()))
                for name, p in model.named_parameters()
            ]
            model(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]).backward()
            for handle in handles:
                handle.remove()
        for p in model.parameters():
            p.grad /= world
        opt.step()
        opt.zero_grad()
    return per_rank


def _sharded(stage: int, offload: dict[str, Any], rows: slice) -> dict[str, list[torch.Tensor]]:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    seen = _hooked(model)
    for step in range(2):
        x, y = global_batch(step)
        opt.backward(model(x[rows], y[rows]))
        opt.step()
        opt.zero_grad()
    return seen


def _assert_same(
    got: dict[str, list[torch.Tensor]], expected: dict[str, list[torch.Tensor]], what: str, exact: bool = True
) -> None:
    assert got.keys() == expected.keys(), what
    for name, grads in expected.items():
        assert len(got[name]) == len(grads) == 2, (what, name)
        for a, b in zip(got[name], grads, strict=True):
            # world 2: the second step's weights come from a reduction summed in another order
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-6), (what, name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tier", ["device", "nvme"])
def test_tensor_hooks_see_the_plain_local_gradient(stage: int, tier: str, tmp_path: Path) -> None:
    offload: dict[str, Any] = {}
    if tier == "nvme":
        offload = {"optimizer": "nvme", "nvme_dir": str(tmp_path), **({"params": "nvme"} if stage == 3 else {})}
    _assert_same(_sharded(stage, offload, slice(None)), _plain()[0], f"stage {stage}, {tier}")


def _world2(rank: int, world: int, folder: str) -> dict[str, list[torch.Tensor]]:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": f"{folder}/r{rank}"}
    half = global_batch(0)[0].shape[0] // world
    return _sharded(3, offload, slice(rank * half, (rank + 1) * half))


def test_each_rank_sees_the_gradient_of_its_own_rows(tmp_path: Path) -> None:
    got, expected = run_ranks(_world2, 2, str(tmp_path)), _plain(2)
    for rank in range(2):
        _assert_same(got[rank], expected[rank], f"rank {rank}", exact=False)
    assert not torch.equal(got[0]["ln_f.weight"][0], got[1]["ln_f.weight"][0])  # each its own rows


def test_a_post_accumulate_grad_hook_sees_no_gradient() -> None:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=2))
    opt = zeroinf.AdamW(model, lr=LR)
    grads: list[Any] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad))
    opt.backward(model(*global_batch(0)))
    assert len(grads) == len(list(model.parameters())) and all(g is None for g in grads)
