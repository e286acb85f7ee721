"""On CUDA (`pytest -m gpu`; skipped without a GPU): what stop 54 added, where the device matters.

- A deleted model and optimizer give their device memory back (runtime/hooks.py [Note: hooks that
  hold the engine weakly]): after `del model, opt` and `gc.collect()`, `torch.cuda.memory_allocated`
  is back at its value before the build (a second build: the first sets up cuBLAS), for states on the
  device and on the host (pinned).
- A second zeroinf.AdamW (optim/succession.py [Note: a second optimizer for one model]) trains as a
  fresh torch AdamW on the same GPU does, to the parity suite's fp32 tolerances, with the states on
  the device and on the host (the step on its worker thread, uploads in flight when it takes over).
"""

from __future__ import annotations

import gc

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, global_batch
from tests.test_parity import TOLERANCES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
OFFLOADS = {"device": {}, "host": {"params": "host", "optimizer": "host"}}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    return x.to(CUDA), y.to(CUDA)


def _sharded(placement: str) -> torch.nn.Module:
    return zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=OFFLOADS[placement]))


def _build_train_delete(placement: str) -> int:
    """Device bytes allocated while the model lives (after two steps); the model is gone on return."""
    model = _sharded(placement)
    opt = zeroinf.AdamW(model, lr=LR)
    for step in range(2):
        opt.backward(model(*_batch(step)))
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA)
    del model, opt
    gc.collect()
    torch.cuda.synchronize()
    return held


@pytest.mark.parametrize("placement", list(OFFLOADS))
def test_a_deleted_model_gives_its_device_memory_back(placement: str) -> None:
    """The first build also sets up what CUDA keeps for good (cuBLAS workspaces): measured from there,
    a second build, trained and deleted, leaves the device as it found it."""
    _build_train_delete(placement)
    before = torch.cuda.memory_allocated(CUDA)
    held = _build_train_delete(placement)
    assert held > before
    assert torch.cuda.memory_allocated(CUDA) == before


@pytest.mark.parametrize("placement", list(OFFLOADS))
def test_a_second_optimizer_trains_as_a_fresh_torch_optimizer_on_the_gpu(placement: str) -> None:
    plain = build_model().to(CUDA)
    ref: torch.optim.Optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, fused=True)
    model = _sharded(placement)
    opt = zeroinf.AdamW(model, lr=LR)
    loss_rtol, weight_atol = TOLERANCES["fp32"]
    for step in range(6):
        if step == 3:
            ref = torch.optim.AdamW(plain.parameters(), lr=LR / 2, fused=True)
            opt = zeroinf.AdamW(model, lr=LR / 2)
        want = plain(*_batch(step))
        want.backward()
        ref.step()
        ref.zero_grad()
        got = model(*_batch(step))
        opt.backward(got)
        opt.step()
        opt.zero_grad()
        assert got.item() == pytest.approx(want.item(), rel=loss_rtol), f"{placement}: step {step}"
    ours = model.state_dict()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(ours[name].to(CUDA), value, rtol=loss_rtol, atol=weight_atol, msg=name)
