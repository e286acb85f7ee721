"""zeroinf.Lion (optim/lion.py): the update against Lion's formula written out, a zero sign leaves a
parameter in place, and over the shards (zeroinf.ShardedOptimizer) at stage 3 on the host and on NVMe
and at stage 1 it trains bitwise as Lion on the plain model; DeepSpeed's "Lion" section builds it
with DeepSpeed's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import build_model
from tests.optim.test_torch_optimizer import _assert_equal, _plain, _sharded


def test_the_update_is_lions_formula() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    want, m = p.detach().clone(), torch.zeros(64)
    opt = zeroinf.Lion([p], lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(64)
        p.grad = g.clone()
        opt.step()
        c = 0.8 * m + 0.2 * g
        want = want * (1 - 0.01 * 0.1) - 0.01 * torch.sign(c)
        m = 0.95 * m + 0.05 * g
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=0, atol=1e-7)


def test_in_blocks_the_update_is_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the update runs in blocks of BLOCK_NUMEL elements (cache-sized; optim/lion.py): the
    same bits as the whole-tensor update, for parameters of several blocks and a last partial one,
    one smaller than a block, and a non-contiguous one (taken whole), over three steps."""
    from zeroinf.optim import lion

    def whole(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        update = m.mul(0.8).add_(g, alpha=0.2).sign_()
        p.mul_(1 - 0.01 * 0.1)
        p.add_(update, alpha=-0.01)
        m.mul_(0.95).add_(g, alpha=0.05)

    monkeypatch.setattr(lion, "BLOCK_NUMEL", 1000)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2500)), torch.nn.Parameter(torch.randn(70, 30)),
              torch.nn.Parameter(torch.randn(40, 60).t())]
    want = [p.detach().clone() for p in params]
    moments = [torch.zeros_like(w) for w in want]
    opt = zeroinf.Lion(params, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(3):
        for p, w, m in zip(params, want, moments, strict=True):
            g = torch.randn_like(w)
            p.grad = g.clone()
            whole(w, g, m)
        opt.step()
        for p, w, m in zip(params, want, moments, strict=True):
            assert torch.equal(p.detach(), w) and torch.equal(opt.state[p]["exp_avg"], m)


def test_a_parameter_with_no_gradient_signal_stays() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    p.grad = torch.tensor([0.0, 0.5, -0.5])
    zeroinf.Lion([p], lr=0.1).step()
    assert p.detach().tolist() == pytest.approx([1.0, 1.9, 3.1])  # sign(0) = 0: the first one stays


def test_bad_settings_are_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    for kwargs in ({"lr": 0.0}, {"betas": (0.9, 1.0)}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError, match="Lion: "):
            zeroinf.Lion([p], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stage", "offload"),
    [(3, {"params": "host", "optimizer": "host"}), (3, {"params": "nvme", "optimizer": "nvme"}), (1, {})],
    ids=["stage3-host", "stage3-nvme", "stage1"],
)
def test_over_shards_it_trains_as_lion_on_the_plain_model(stage: int, offload: dict, tmp_path: Path) -> None:
    settings = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}
    offload = {**offload, "nvme_dir": str(tmp_path)} if offload.get("optimizer") == "nvme" else offload
    _assert_equal(_sharded(zeroinf.Lion, settings, stage, offload), _plain(zeroinf.Lion, settings), f"stage {stage}")


def test_deepspeeds_lion_section_builds_it_with_deepspeeds_defaults() -> None:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt, _ = zeroinf.optimizer_from_deepspeed(model, {"optimizer": {"type": "Lion", "params": {"lr": 2e-4}}})
    assert isinstance(opt, zeroinf.ShardedOptimizer) and opt.display_name == "zeroinf.ShardedOptimizer(Lion)"
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (2e-4, (0.9, 0.999), 0.0)
    assert opt.state_names == ("exp_avg",)
