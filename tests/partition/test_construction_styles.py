"""`zeroinf.init()` reproduces eager construction for every way PyTorch code builds a parameter.

tests/partition/_styles.py: reset_parameters, torch.ones/randn/eye/full/tensor in `__init__`,
`nn.init` on a registered parameter (xavier, orthogonal's QR), draws under no_grad and through
`.data` (and `.data = ` a new tensor), computed buffers persistent or not (one from a weight),
a parameter computed from another, ParameterList/Dict, the norms (BatchNorm's int64 counter),
convolution, attention, a GRU, the weight_norm and spectral_norm parametrizations, a generator of
the module's own, a tied head, and the parent changing its children's weights after they are built.
Eager construction + `shard` and `zeroinf.init(cfg)` + `shard` from the same seed: the gathered
`state_dict` and every buffer bitwise equal, and the same forward output, with stage-3 parameters on
device, host and NVMe, at world 1 (in this process) and 3 (shards that do not divide evenly).

It grew from 400 random compositions of these styles (worlds 1-3): one failed, a parent reading a
weight-normed Linear's computed weight while building (`weight.data.mul_`) left an autograd graph
holding its parameters, and parking one then stopped the build inside `torch.utils.swap_tensors`
("Expected use_count ... but got 3"). Such a parameter now stays whole until that graph is gone
(partition/park.py `_swappable`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests.partition._styles import AllStyles, D

TIERS = ["device", "host", "nvme"]


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {f"param:{k}": v.clone() for k, v in model.state_dict().items()}
    state.update({f"buffer:{k}": b.clone() for k, b in model.named_buffers()})
    return state


def _case(tier: str, rank: int, root: str) -> dict[str, Any]:
    folder = os.path.join(root, f"{tier}-rank{rank}")
    os.makedirs(folder, exist_ok=True)
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0,
        offload=zeroinf.OffloadConfig(params=tier, nvme_dir=folder if tier == "nvme" else None),
    )
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    out = {}
    for how in ("eager", "init"):
        torch.manual_seed(0)
        if how == "eager":
            model = AllStyles()
        else:
            with zeroinf.init(cfg):
                model = AllStyles()
        zeroinf.shard(model, cfg)
        model.eval()
        with torch.no_grad():
            y = model(x)
        out[how] = {"state": _snapshot(model), "y": y}
        zeroinf.engine_of(model).close()
    return out


def _cases(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {tier: _case(tier, rank, root) for tier in TIERS}


@pytest.fixture(scope="module", params=[1, 3], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, dict[str, Any]]]]:
    world = request.param
    with tempfile.TemporaryDirectory(prefix="zeroinf-styles-") as root:
        if world == 1:
            return world, [_cases(0, 1, root)]
        return world, run_ranks(_cases, world, root, timeout_s=240)


@pytest.mark.parametrize("tier", TIERS)
def test_every_construction_style_builds_the_eager_model_bitwise(results, tier: str) -> None:
    world, per_rank = results
    for rank, cases in enumerate(per_rank):
        eager, init = cases[tier]["eager"], cases[tier]["init"]
        where = f"world {world} rank {rank} params on {tier}"
        assert init["state"].keys() == eager["state"].keys(), where
        differ = [k for k, v in eager["state"].items() if v.dtype != init["state"][k].dtype
                  or not torch.equal(v, init["state"][k])]
        assert not differ, (where, differ)
        assert torch.equal(init["y"], eager["y"]), where


def test_the_styles_model_is_the_plain_model_after_shard() -> None:
    """The oracle itself: sharding the eagerly built model changes neither its values nor its output."""
    torch.manual_seed(0)
    plain = AllStyles().eval()
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = plain(x)
    state = _snapshot(plain)
    torch.manual_seed(0)
    model = zeroinf.shard(AllStyles(), zeroinf.Config(stage=3, persist_threshold_bytes=0)).eval()
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        got = _snapshot(model)
        assert all(torch.equal(got[k], v) for k, v in state.items())
    finally:
        zeroinf.engine_of(model).close()
