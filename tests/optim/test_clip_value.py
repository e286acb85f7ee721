"""`Config.grad_clip_value`: every gradient element clamped before the step, as plain PyTorch's
`torch.nn.utils.clip_grad_value_` between backward and `optimizer.step()`.

Against the parity oracle of tests/_parity.py (the reference clamps the whole model's gradients,
averaged over the global batch, loss scale removed) with its tolerances, at worlds 1 and 2 (one
spawned group each): stages 0-3; states on the device, the host and NVMe; gradients on NVMe (read
back at the step: `GradOnDisk`); the step inside backward ("final"), after it, and speculative
(fp16, undone on the overflow step); accumulation; bf16. 1e-3 clamps about 30% of the first
step's gradient elements (the 70th percentile of |g|), and the reference with and without the clamp
ends far apart, so a clamp the engine skipped would show. A loop's own
`torch.nn.utils.clip_grad_value_(model.parameters(), v)` call passes with `grad_clip_value = v`
and is refused otherwise (tests/optim/test_torch_clip.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests._parity import Case, build_model, global_batch, run_cases, train_reference
from tests.test_parity import assert_matches_reference
from zeroinf import OffloadConfig

CLIP_VALUE = 1e-3
S3 = (("persist_threshold_bytes", 0),)


def _offload(root: Path, name: str, **tiers: object) -> tuple[tuple[str, object], ...]:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    return (("offload", OffloadConfig(**tiers, nvme_dir=str(folder), sub_group_numel=5000)),)  # type: ignore[arg-type]


def _cases(root: Path) -> list[Case]:
    c = CLIP_VALUE
    return [
        Case("s0-fp32", 0, clip_value=c, steps=6),
        Case("s1-fp32-accum2", 1, accum=2, clip_value=c, steps=6),
        Case("s2-fp32-opt-host", 2, clip_value=c, steps=6, overrides=_offload(root, "a", optimizer="host")),
        Case("s2-bf16", 2, "bf16", clip_value=c, steps=6),
        Case("s3-fp32", 3, clip_value=c, steps=6, overrides=S3),
        Case(
            "s3-fp32-after-backward", 3, clip_value=c, steps=6,
            overrides=S3 + _offload(root, "b", step_in_backward=False),
        ),
        Case(
            "s3-fp32-nvme-accum2", 3, accum=2, clip_value=c, steps=6,
            overrides=S3 + _offload(root, "c", params="nvme", optimizer="nvme", gradients="nvme"),
        ),
        Case(
            "s3-fp16-speculative", 3, "fp16", clip_value=c, steps=6, overflow_step=3,
            overrides=S3 + _offload(root, "d", params="host", optimizer="host", step_in_backward=True),
        ),
    ]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def world_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[Case], dict[str, list[dict]]]:
    world = request.param
    cases = _cases(tmp_path_factory.mktemp(f"clip-value-world{world}"))
    per_rank = run_ranks(run_cases, world, cases, timeout_s=300)
    return world, cases, {c.name: [r[c.name] for r in per_rank] for c in cases}


def test_matches_plain_pytorch_with_clip_grad_value(world_results: tuple) -> None:
    world, cases, results = world_results
    for case in cases:
        losses, weights = train_reference(case)
        assert_matches_reference(f"{case.name} world {world}", results[case.name], losses, weights, case.dtype)
        if case.dtype == "fp16":
            assert results[case.name][0]["skipped"][case.overflow_step], case.name
            assert results[case.name][0]["rollbacks"] >= 1, case.name  # the speculative step was undone


def test_the_clamp_matters() -> None:
    """The oracle with and without the clamp ends far beyond the fp32 tolerance, and the clamp cuts
    a good share of the first step's gradient elements."""
    case = Case("s0", 0, clip_value=CLIP_VALUE, steps=6)
    _, clamped = train_reference(case)
    _, free = train_reference(dataclasses.replace(case, clip_value=None))
    assert max((clamped[k] - free[k]).abs().max().item() for k in free) > 1e-3
    torch.manual_seed(0)
    model = build_model()
    model(*global_batch(0)).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).abs()
    assert 0.2 < float((grads > CLIP_VALUE).float().mean()) < 0.5


def test_a_loop_calling_clip_grad_value_trains_as_with_the_config_alone() -> None:
    """nanoGPT-style: the loop's own clip_grad_value_ call with the configured value changes nothing."""
    results = []
    for call in (False, True):
        torch.manual_seed(0)
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, grad_clip_value=CLIP_VALUE, **dict(S3)))
        opt = zeroinf.AdamW(model, lr=3e-3)
        try:
            for step in range(3):
                opt.backward(model(*global_batch(step)))
                if call:
                    torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
                opt.step()
                opt.zero_grad()
            results.append({k: v.clone() for k, v in model.state_dict().items()})
        finally:
            zeroinf.engine_of(model).close()
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"grad_clip_value": 0.0}, "use a positive finite number"),
        ({"grad_clip_value": float("inf")}, "use a positive finite number"),
        ({"grad_clip_value": True}, "use a positive finite number"),
        ({"grad_clip_value": 1.0, "grad_clip_norm": 1.0}, "not both"),
    ],
)
def test_bad_values_are_refused(fields: dict, expected: str) -> None:
    with pytest.raises(zeroinf.ConfigError, match=expected):
        zeroinf.Config(**fields)


def test_a_call_with_another_value_or_part_of_the_model_is_refused() -> None:
    torch.manual_seed(0)
    model: nn.Module = zeroinf.shard(build_model(), zeroinf.Config(stage=2, grad_clip_value=CLIP_VALUE))
    opt = zeroinf.AdamW(model, lr=3e-3)
    try:
        opt.backward(model(*global_batch(0)))
        with pytest.raises(RuntimeError, match="Config.grad_clip_value is 0.001 and the engine clamps with that"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        with pytest.raises(RuntimeError, match="pass model.parameters()"):
            torch.nn.utils.clip_grad_value_(list(model.parameters())[:2], CLIP_VALUE)
    finally:
        zeroinf.engine_of(model).close()
