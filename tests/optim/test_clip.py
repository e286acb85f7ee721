"""Clipping matches torch.nn.utils.clip_grad_norm_: the same total norm and, given it, the same fp32 coefficient."""

from __future__ import annotations

import pytest
import torch

from zeroinf.optim.clip import CLIP_EPS, clip_coefficient, global_grad_norm
from zeroinf.topology import Topology

TOPO = Topology.single(torch.device("cpu"))


def _random_params(seed: int, scale: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 3), (11,), (), (4, 5, 2)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=gen) * scale
        params.append(p)
    return params


@pytest.mark.parametrize("max_norm", [0.01, 0.5, 1.0, 1e3])
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_coefficient_matches_torch(max_norm: float, scale: float) -> None:
    params = _random_params(seed=int(scale * 100) + 7, scale=scale)
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    coef = clip_coefficient(float(total), max_norm)
    assert 0 < coef <= 1.0
    for p, g in zip(params, before, strict=True):  # the same fp32 coefficient: the same gradients, bitwise
        assert torch.equal(p.grad, g * coef)


def test_coefficient_is_one_below_the_limit_and_safe_at_zero() -> None:
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert clip_coefficient(2.0, 1.0) == float(1.0 / (torch.tensor(2.0) + CLIP_EPS))  # in fp32, as torch
    assert clip_coefficient(2.0, 1.0) != 1.0 / (2.0 + CLIP_EPS)  # not the double quotient


@pytest.mark.parametrize("sharded", [False, True])
def test_global_norm_matches_torch_at_world_one(sharded: bool) -> None:
    params = _random_params(seed=3, scale=2.0)
    grads = [p.grad for p in params]
    norm = global_grad_norm(grads, TOPO, sharded=sharded)  # type: ignore[arg-type]
    assert norm.dtype == torch.float32 and norm.dim() == 0
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
    torch.testing.assert_close(norm, expected.to(torch.float32), rtol=1e-6, atol=0)


def test_global_norm_of_flat_ranges_equals_norm_of_pieces() -> None:
    params = _random_params(seed=5, scale=1.0)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    padded = torch.cat([flat, torch.zeros(64 - flat.numel() % 64)])  # padding holds zeros
    pieces = global_grad_norm([p.grad for p in params], TOPO, sharded=False)  # type: ignore[misc]
    ranges = global_grad_norm(list(padded.split(40)), TOPO, sharded=True)
    torch.testing.assert_close(pieces, ranges, rtol=1e-6, atol=0)


def test_global_norm_low_precision_grads_accumulate_in_fp32() -> None:
    g = torch.full((4096,), 300.0, dtype=torch.float16)  # the squared sum overflows fp16
    norm = global_grad_norm([g], TOPO, sharded=False)
    assert torch.isfinite(norm)
    torch.testing.assert_close(norm, torch.tensor(300.0 * 64.0), rtol=1e-6, atol=0)


def test_global_norm_flags_overflow() -> None:
    g = torch.tensor([1.0, float("inf")])
    assert not torch.isfinite(global_grad_norm([g], TOPO, sharded=True))
    assert not torch.isfinite(global_grad_norm([torch.tensor([float("nan")])], TOPO, sharded=False))


def test_global_norm_of_nothing_is_zero() -> None:
    norm = global_grad_norm([], TOPO, sharded=True)
    assert norm.item() == 0.0 and norm.device == TOPO.device


def test_a_square_kept_from_nvme_gives_the_in_memory_norm_bit_for_bit() -> None:
    """Units whose shards went to NVMe give their squared norm kept at write time; mixed with units in
    memory, in any pattern, the norm is the same bits as with every unit in memory (optim/clip.py
    [Note: one norm wherever the gradients are]). Summing the kept squares in double first, as before,
    differs in the last bit for these values (seed 6: units 0, 2 and 3 on NVMe)."""
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(n, generator=gen) * s for n, s in ((5000, 1e-3), (777, 3.0), (4096, 0.2), (31, 40.0))]
    in_memory = global_grad_norm(grads, TOPO, sharded=False)
    squares = [float(torch.linalg.vector_norm(g, dtype=torch.float32) ** 2) for g in grads]
    for on_disk in ((0,), (1, 3), (0, 1, 2, 3), (2,)):
        mixed = [squares[i] if i in on_disk else g for i, g in enumerate(grads)]
        assert torch.equal(global_grad_norm(mixed, TOPO, sharded=False), in_memory), on_disk
    double_first = torch.tensor(squares[0] + squares[2] + squares[3], dtype=torch.float32)  # the old way
    double_first += torch.linalg.vector_norm(grads[1], dtype=torch.float32) ** 2
    assert not torch.equal(double_first.sqrt(), in_memory)
