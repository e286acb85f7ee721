"""The tier layer owns NVMe I/O: no module outside `aio/` and `tiers/` builds an engine or a swap file,
and an engine's shards, optimizer states and checkpoints go through the one `NvmeTier` it built."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import zeroinf
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.tiers.nvme_tier import LANES, NvmeTier

PACKAGE = pathlib.Path(zeroinf.__file__).parent
OWNERS = ("aio", "tiers")  # the packages allowed to construct what follows
CONSTRUCTORS = {"AioEngine", "NvmeSwap", "plan_swap_layout"}


def constructions_outside_tiers(package: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] in OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if name in CONSTRUCTORS:
                    found.append(f"{rel}:{node.lineno} calls {name}")
    return found


def test_no_engine_or_swap_file_is_built_outside_the_tier_layer() -> None:
    assert constructions_outside_tiers() == []


def test_the_check_sees_a_construction(tmp_path: pathlib.Path) -> None:
    """The scan is not vacuous: a module that builds an engine is reported."""
    fake = tmp_path / "zeroinf"
    (fake / "optim").mkdir(parents=True)
    (fake / "tiers").mkdir()
    (fake / "optim" / "bad.py").write_text("from zeroinf.aio import AioEngine\nengine = AioEngine()\n")
    (fake / "tiers" / "fine.py").write_text("from zeroinf.aio import AioEngine\nengine = AioEngine()\n")
    assert constructions_outside_tiers(fake) == ["optim/bad.py:2 calls AioEngine"]


def test_an_engine_on_nvme_uses_one_tier_for_params_grads_optimizer_and_checkpoints(tmp_path: pathlib.Path) -> None:
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=str(tmp_path / "swap"))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)
    torch.manual_seed(0)
    model = zeroinf.shard(GPT(GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=16)), cfg)
    opt = zeroinf.AdamW(model, lr=1e-3)
    engine = zeroinf.engine_of(model)
    tier = engine.nvme_tier
    x = torch.randint(0, 256, (2, 16))
    opt.backward(model(x, x))
    opt.step()
    zeroinf.save(str(tmp_path / "ckpt"), model, opt, step=1)
    lanes = tier._engines
    assert set(lanes) == set(LANES)
    assert engine.param_files is not None and engine.param_files.engine is lanes["params"]
    assert engine.grad_files is not None and engine.grad_files.swap.engine is lanes["grads"]
    assert opt.states.engine is lanes["optimizer"]
    assert lanes["checkpoint"].stats().bytes_written > 0
    swap_files = sorted(p.name for p in (tmp_path / "swap").iterdir())
    assert swap_files and all(name.startswith("zeroinf-rank0-") for name in swap_files)
    engine.close()
    opt.states.close()
    assert not any((tmp_path / "swap").iterdir())  # the tier removed every swap file it opened
    assert tier._engines == {}


def test_a_tier_refuses_an_unknown_lane_and_a_missing_folder() -> None:
    tier = NvmeTier(zeroinf.OffloadConfig(), rank=0)
    with pytest.raises(ValueError, match="unknown I/O lane 'disk'"):
        tier.engine("disk")
    with pytest.raises(ValueError, match="offload.nvme_dir is not set"):
        tier.open_swap("params", {("u", "param_shard"): 4096})
    tier.close()
