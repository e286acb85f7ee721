"""`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` over a sharded model.

optim/torch_clip.py [Note: torch's clip_grad_norm_ over a sharded model]. With
`Config.grad_clip_norm = max_norm` the call returns the global norm before clipping and the step
clips with it: the returned norm equals `opt.last_grad_norm` bitwise, the run ends bitwise where the
same run without the call ends (the call changes nothing), and the norms equal torch's on the plain
model within 1e-5 (another summation order). Stages 1-3, states in memory, on the host and on
NVMe, gradients on NVMe, the step inside backward or after it, fp32 and fp16 (the norm is
returned without the loss scale), worlds 1 and 2; 0.6 clips steps 0 and 3 and not 1 and 2, so
both outcomes of the speculative step are taken. The call goes through `clip_grad_norm_`
imported by name before any model was sharded (the wrapped functions are the ones it calls).
Every other use is refused by name: no `grad_clip_norm`, another `max_norm` or norm type, part of
the parameters, a mix with other parameters, a norm computed elsewhere, in mid-accumulation.
Parameters of unsharded models clip as before. `clip_grad_value_` over a sharded model without
`grad_clip_value` is refused (it clipped nothing); over a plain one it clamps as before. On torch
2.4-2.5 `clip_grad_norm_` itself is wrapped; that wrapper is tested over this torch's function.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_  # by name, before zeroinf wraps anything

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, plain_grad_norms
from zeroinf.optim.torch_clip import ClipGradNormError

CLIP = 0.6
STEPS = 4
CASES = [  # (stage, params tier, optimizer tier, gradients tier, step_in_backward, param_dtype)
    (1, "device", "device", "device", "auto", "fp32"),
    (2, "device", "host", "host", "auto", "fp32"),
    (3, "device", "device", "device", False, "fp32"),
    (3, "nvme", "host", "host", "auto", "fp32"),
    (3, "nvme", "nvme", "nvme", "auto", "fp32"),
    (3, "host", "host", "host", "auto", "fp16"),
]


def _run(rank: int, world: int, case: tuple, call: bool, swap: str) -> dict[str, Any]:
    stage, params, optimizer, gradients, in_backward, dtype = case
    folder = os.path.join(swap, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    offload = zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, gradients=gradients, step_in_backward=in_backward,
        nvme_dir=folder if "nvme" in case[1:4] else None,
    )
    cfg = zeroinf.Config(
        stage=stage, offload=offload, grad_clip_norm=CLIP, persist_threshold_bytes=0, param_dtype=dtype
    )
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    returned, logged = [], []
    per = 8 // world
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.backward(model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        if call:
            norm = clip_grad_norm_(model.parameters(), CLIP)
            returned.append((norm.dtype, norm.item()))
        opt.step()
        opt.zero_grad()
        logged.append(opt.last_grad_norm)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    zeroinf.engine_of(model).close()
    return {"returned": returned, "logged": logged, "weights": weights, "rollbacks": opt.rollbacks}


def _runs(rank: int, world: int) -> list[dict[str, dict[str, Any]]]:
    out = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as swap:
            called = _run(rank, world, case, True, swap)
            out.append({"called": called, "configured": _run(rank, world, case, False, swap)})
    return out


@pytest.fixture(scope="module", params=[1, 2])
def results(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, dict[str, Any]]]]]:
    world = request.param
    return world, run_ranks(_runs, world, timeout_s=300)


def _reference_norms() -> list[float]:
    return plain_grad_norms(STEPS, CLIP)


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_clip_grad_norm_returns_the_norm_the_engine_clips_with(results, index: int) -> None:
    world, per_rank = results
    reference = _reference_norms()
    assert [n > CLIP for n in reference] == [True, False, False, True]  # both outcomes are taken
    for rank, runs in enumerate(per_rank):
        called, configured = runs[index]["called"], runs[index]["configured"]
        where = f"world {world} rank {rank} {CASES[index]}"
        assert [v for _, v in called["returned"]] == called["logged"], where
        assert all(dtype == torch.float32 for dtype, _ in called["returned"]), where
        assert called["logged"] == configured["logged"], where
        assert called["rollbacks"] == configured["rollbacks"], where
        for name, value in configured["weights"].items():
            assert torch.equal(called["weights"][name], value), f"{where}: the call changed {name}"
        if CASES[index][-1] == "fp32":
            assert called["logged"] == pytest.approx(reference, rel=1e-5), where


# -- refusals, in this process (world 1) --------------------------------------------------------------


def _sharded(**fields: Any) -> tuple[nn.Module, zeroinf.AdamW]:
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, **fields))
    return model, zeroinf.AdamW(model, lr=LR)


def _backward(model: nn.Module, opt: zeroinf.AdamW) -> None:
    x, y = global_batch(0)
    opt.backward(model(x, y))


@pytest.mark.parametrize(
    ("fields", "call", "expected"),
    [
        ({}, lambda m: clip_grad_norm_(m.parameters(), 1.0), "Set grad_clip_norm=1 in the zeroinf Config"),
        ({"grad_clip_norm": 0.5}, lambda m: clip_grad_norm_(m.parameters(), 1.0), "Config.grad_clip_norm is 0.5"),
        ({"grad_clip_norm": 1.0}, lambda m: clip_grad_norm_(m.parameters(), 1.0, norm_type="inf"),
         "norm_type=inf"),
        ({"grad_clip_norm": 1.0}, lambda m: clip_grad_norm_(list(m.parameters())[:2], 1.0), "pass model.parameters()"),
        ({"grad_clip_norm": 1.0},
         lambda m: torch.nn.utils.clip_grads_with_norm_(m.parameters(), 1.0, torch.tensor(2.0)), "computed elsewhere"),
    ],
    ids=["no-grad-clip-norm", "other-max-norm", "inf-norm", "subset", "foreign-norm"],
)
def test_what_the_engine_cannot_do_is_refused_by_name(fields: dict, call: Any, expected: str) -> None:
    model, opt = _sharded(**fields)
    try:
        _backward(model, opt)
        with pytest.raises(ClipGradNormError, match=expected):
            call(model)
    finally:
        zeroinf.engine_of(model).close()


def test_a_mix_with_other_parameters_that_have_gradients_is_refused() -> None:
    model, opt = _sharded(grad_clip_norm=1.0)
    other = nn.Linear(3, 3)
    other(torch.ones(1, 3)).sum().backward()
    try:
        _backward(model, opt)
        with pytest.raises(ClipGradNormError, match="clip them in separate calls"):
            clip_grad_norm_([*model.parameters(), *other.parameters()], 1.0)
    finally:
        zeroinf.engine_of(model).close()


def test_mid_accumulation_is_refused_and_the_step_boundary_works() -> None:
    model, opt = _sharded(grad_clip_norm=1.0, grad_accum_steps=2)
    try:
        _backward(model, opt)
        with pytest.raises(RuntimeError, match="after 1 of the step's 2 backward passes"):
            clip_grad_norm_(model.parameters(), 1.0)
        _backward(model, opt)
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        assert norm.item() == opt.last_grad_norm > 0
    finally:
        zeroinf.engine_of(model).close()


def test_zero_grad_after_the_norm_discards_it() -> None:
    model, opt = _sharded(grad_clip_norm=1e9, offload=zeroinf.OffloadConfig(step_in_backward=False))
    try:
        _backward(model, opt)
        first = clip_grad_norm_(model.parameters(), 1e9).item()
        opt.zero_grad()
        x, y = global_batch(1)
        opt.backward(model(x, y) * 3)
        second = clip_grad_norm_(model.parameters(), 1e9).item()
        opt.step()
        assert second == opt.last_grad_norm != first
    finally:
        zeroinf.engine_of(model).close()


def test_unsharded_parameters_clip_as_before() -> None:
    _sharded(grad_clip_norm=1.0)  # the wrappers are installed
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        (m(torch.ones(2, 4)) * 10).sum().backward()
    got = clip_grad_norm_(a.parameters(), 0.5)
    grads = [p.grad for p in b.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(0.5 / (expected + 1e-6), max=1.0))
    assert torch.equal(got, expected)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_clip_grad_value_over_a_sharded_model_is_refused_and_plain_models_clip_as_before() -> None:
    model, opt = _sharded(grad_clip_norm=1.0)
    try:
        _backward(model, opt)
        with pytest.raises(ClipGradNormError, match=r"clip_grad_value_\(\.\.\., 0\.5\).*would clip nothing"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
    finally:
        zeroinf.engine_of(model).close()
    plain = nn.Linear(4, 4)
    (plain(torch.ones(2, 4)) * 10).sum().backward()
    expected = [p.grad.clamp(-0.5, 0.5) for p in plain.parameters()]
    torch.nn.utils.clip_grad_value_(plain.parameters(), 0.5)
    assert all(torch.equal(p.grad, e) for p, e in zip(plain.parameters(), expected, strict=True))


def test_torch_before_2_6_clips_through_a_wrapped_clip_grad_norm() -> None:
    """torch 2.4 and 2.5 compute clip_grad_norm_ inline (no `_get_total_norm` to wrap): there the
    function itself is wrapped. The wrapper over this torch's function behaves as the 2.6+ path:
    the global norm, equal to the step's bitwise, refusals by name, plain parameters untouched."""
    from zeroinf.optim.torch_clip import _clip_grad_norm_through_engine

    whole = _clip_grad_norm_through_engine(clip_grad_norm_)  # sharded parameters never reach it
    model, opt = _sharded(grad_clip_norm=CLIP, offload=zeroinf.OffloadConfig(step_in_backward=False))
    try:
        _backward(model, opt)
        returned = whole(model.parameters(), CLIP)
        opt.step()
        assert returned.item() == opt.last_grad_norm
        assert returned.item() == pytest.approx(plain_grad_norms(1, CLIP)[0], rel=1e-5)
        opt.zero_grad()
        _backward(model, opt)
        with pytest.raises(ClipGradNormError, match="make them equal"):
            whole(model.parameters(), 2 * CLIP)
    finally:
        zeroinf.engine_of(model).close()
    plain = nn.Linear(4, 4)
    (plain(torch.ones(2, 4)) * 10).sum().backward()
    norm = whole(plain.parameters(), 0.5)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in plain.parameters()]))
    assert norm.item() > 0.5 and clipped.item() <= 0.5 + 1e-6
