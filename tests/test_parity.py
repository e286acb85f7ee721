"""Parity with plain single-process PyTorch: stage {0,1,2} x world {1,2,4} x dtype, + accumulation,
clipping and an fp16 overflow that must skip exactly one step. One spawned group per world size runs
every case; the single-process reference is computed once per case in the test process. Inside each
group the cases without clipping also train by plain data parallelism (fp32: torch's
DistributedDataParallel; bf16: the same by hand with fp32 masters), and there is no tolerance against
it at one and two ranks: bitwise (`test_two_ranks_are_bitwise_plain_data_parallelism`).

Tolerances:
- fp32: rtol 1e-5 on losses and weights ("close to bitwise"): only the order of floating-point sums
  differs (per-rank partial gradients added by the collective, the fused AdamW kernel). Weights also
  get atol 5e-5 (1.7% of one lr step): where an element's gradient is near zero, Adam's g / sqrt(v)
  turns the last-bit differences of g into visible differences of the update (seen: 1.2e-5 on one
  element of 1024 at world 4).
- bf16/fp16: both sides hold identical fp32 masters and round them identically to the compute dtype,
  but each rank computes its gradients on a slice of the batch in the low-precision dtype, so
  per-sample contributions are rounded before (not after) they are summed: gradients differ by a
  few units of the compute dtype's epsilon (bf16: 2^-8 = 3.9e-3). Adam normalizes the update, so
  weights differ by a small fraction of lr per step: we allow 0.5 * lr * steps on weights and 2e-2
  relative on losses (bf16), half that for fp16 (2^-11 epsilon, but a 2-sample slice per rank at
  world 4). A wrong sharding (a dropped shard update, a missing all-gather) moves weights by ~lr per
  step and losses by far more.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import LR, Case, run_cases, train_reference

S3 = (("persist_threshold_bytes", 0),)
CKPT = (("activation_checkpointing", True),)
CKPT_OFFLOAD = CKPT + (("offload_activations", True),)
BLOCK_BYTES = 12 * 32 * 32 * 4 + 4096  # one block's unsharded fp32 bytes, rounded up

CASES = [Case(f"s{s}-{d}", s, d) for s in (0, 1, 2) for d in ("fp32", "bf16")] + [
    Case("s2-fp32-accum2", 2, accum=2),
    Case("s2-fp32-accum2-sync", 2, accum=2, sync_every_micro_step=True),
    Case("s1-bf16-accum2-sync", 1, "bf16", accum=2, sync_every_micro_step=True),
    Case("s2-bf16-accum2", 2, "bf16", accum=2),
    Case("s1-fp32-clip", 1, clip=0.05),
    Case("s2-bf16-clip", 2, "bf16", clip=0.05),
    Case("s0-fp16-overflow", 0, "fp16", overflow_step=4),
    Case("s2-fp16-overflow", 2, "fp16", overflow_step=4),
    # stage 3: every block sharded (no resident tiny units), with and without a live-bytes cap
    Case("s3-fp32", 3, overrides=S3),
    Case("s3-bf16", 3, "bf16", overrides=S3),
    Case("s3-fp32-accum2", 3, accum=2, overrides=S3),
    Case("s3-bf16-clip-live2", 3, "bf16", clip=0.05, overrides=S3 + (("max_live_bytes", 2 * BLOCK_BYTES),)),
    Case("s3-fp16-overflow", 3, "fp16", overflow_step=4, overrides=S3),
    # no prefetch: only the last block of forward stays gathered into backward
    Case("s3-fp32-prefetch0", 3, overrides=S3 + (("prefetch_bytes", 0),)),
    # models we did not write (tests/_zoo.py): cross-unit ties, reuse, external module use, unused
    # and frozen parameters, buffers, nested depths, kwargs and dict outputs
    Case("zoo-s2-fp32", 2, model="zoo"),
    Case("zoo-s3-fp32", 3, model="zoo", overrides=S3),
    Case("zoo-s3-bf16", 3, "bf16", model="zoo", overrides=S3),
    Case("zoo-s3-fp32-accum2", 3, accum=2, model="zoo", overrides=S3 + (("max_live_bytes", BLOCK_BYTES),)),
    # activation checkpointing, and checkpointing with the kept inputs offloaded to host memory
    Case("s2-fp32-ckpt", 2, overrides=CKPT),
    Case("s2-bf16-ckpt-offload", 2, "bf16", overrides=CKPT_OFFLOAD),
    Case("s3-fp32-ckpt", 3, overrides=S3 + CKPT),
    Case("s3-fp32-ckpt-offload", 3, overrides=S3 + CKPT_OFFLOAD),
    Case("zoo-s3-bf16-ckpt-offload", 3, "bf16", model="zoo", overrides=S3 + CKPT_OFFLOAD),
    # odd-sized parameters, cut by the shard boundaries at odd elements of their own
    Case("odd-s1-fp32", 1, model="odd"),
    Case("odd-s3-fp32", 3, model="odd", overrides=S3),
]
# Cases without clipping trained by plain data parallelism in the same group too: fp32 through torch's
# DDP (train_torch_ddp) where zeroinf reduces once per step as DDP does (stage 3 reduces every
# micro-step, so its accumulation sums in another order), bf16 likewise by hand with fp32 masters
# (train_data_parallel_with_masters)
DDP_CASES = tuple(
    c.name for c in CASES
    if c.clip is None and not c.sync_every_micro_step
    and c.dtype in ("fp32", "bf16") and (c.accum == 1 or c.stage < 3)
)
TOLERANCES = {  # (loss rtol, weight atol)
    "fp32": (1e-5, 5e-5),
    "bf16": (2e-2, 0.5 * LR * 10),
    "fp16": (5e-3, 0.25 * LR * 10),
}


@functools.cache
def reference(case: Case) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    norms: list[float] = []
    losses, weights = train_reference(case, grad_norms=norms)
    return losses, weights, norms


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def world_results(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[dict]]]:
    world = request.param
    per_rank = run_ranks(run_cases, world, CASES, DDP_CASES, timeout_s=300)
    return world, {case.name: [r[case.name] for r in per_rank] for case in CASES}


def assert_matches_reference(
    where: str, per_rank: list[dict], ref_losses: list[float], ref_weights: dict[str, torch.Tensor], dtype: str,
    tolerances: str | None = None,
) -> None:
    """Rank 0's losses and weights against the reference, with the tolerances of `tolerances` (default:
    `dtype`'s; weights also relative in fp32); a NaN reference loss is a skipped step. Every rank saw
    the same (all-reduced) losses: nothing diverged between ranks."""
    loss_rtol, weight_atol = TOLERANCES[tolerances or dtype]
    ours = per_rank[0]
    for step, (a, b) in enumerate(zip(ours["losses"], ref_losses, strict=True)):
        if not math.isnan(b):
            assert a == pytest.approx(b, rel=loss_rtol), f"{where}: loss at step {step}: {a} vs {b}"
    for name, ref in ref_weights.items():
        torch.testing.assert_close(
            ours["weights"][name], ref, rtol=loss_rtol if dtype == "fp32" else 0, atol=weight_atol,
            msg=lambda m, name=name: f"{where}: weight {name}: {m}",
        )
    for r, other in enumerate(per_rank[1:], start=1):
        assert other["losses"] == pytest.approx(ours["losses"], nan_ok=True), f"{where}: rank {r} disagrees with rank 0"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_plain_pytorch(world_results: tuple[int, dict], case: Case) -> None:
    world, results = world_results
    ref_losses, ref_weights, _ = reference(case)
    assert_matches_reference(f"{case.name} world {world}", results[case.name], ref_losses, ref_weights, case.dtype)


def test_two_ranks_are_bitwise_plain_data_parallelism(world_results: tuple[int, dict]) -> None:
    """Against plain data parallelism in the same group: in fp32 torch's DistributedDataParallel with
    fused AdamW, in bf16 the same by hand with fp32 masters. At one and two ranks every stage gives
    bitwise its losses and weights, activation checkpointing, offloaded activations, no prefetch, the
    zoo and odd-sized parameters cut by shard boundaries included. Two addends sum to the same float
    in either order and halving is exact, so any difference would be zeroinf's; at four ranks the
    partial gradients are summed in other orders ((a + b) + (c + d) against a ring), so the parity
    tolerance of the dtype applies there."""
    world, results = world_results
    assert len(DDP_CASES) == 21, DDP_CASES  # the guard against a filter that drops cases
    for name in DDP_CASES:
        ours, ddp = results[name][0], results[name][0]["ddp"]
        dtype = next(c.dtype for c in CASES if c.name == name)
        loss_rtol, weight_atol = TOLERANCES[dtype]
        if world <= 2:
            assert ours["losses"] == ddp["losses"], f"{name} world {world}: {ours['losses']} vs DDP {ddp['losses']}"
            differing = [k for k, w in ddp["weights"].items() if not torch.equal(ours["weights"][k], w)]
            assert not differing, f"{name} world {world}: weights differ from DDP's: {differing}"
        else:
            assert ours["losses"] == pytest.approx(ddp["losses"], rel=loss_rtol), name
            for k, w in ddp["weights"].items():
                torch.testing.assert_close(ours["weights"][k], w, rtol=loss_rtol if dtype == "fp32" else 0,
                                           atol=weight_atol, msg=name)


@pytest.mark.parametrize("case", [c for c in CASES if c.clip is not None or c.dtype != "fp16"], ids=lambda c: c.name)
def test_last_grad_norm_is_torchs_clip_norm(world_results: tuple[int, dict], case: Case) -> None:
    """`AdamW.last_grad_norm` is the total norm `clip_grad_norm_` returns on the plain model (before
    clipping), the same on every rank; without clipping (and not fp16) no norm is computed: None."""
    world, results = world_results
    _, _, ref_norms = reference(case)
    if case.clip is None:
        assert all(r["grad_norms"] == [None] * case.steps for r in results[case.name])
        return
    rtol = TOLERANCES[case.dtype][0]
    for step, (a, b) in enumerate(zip(results[case.name][0]["grad_norms"], ref_norms, strict=True)):
        assert a == pytest.approx(b, rel=rtol), f"{case.name} world {world}: grad norm at step {step}: {a} vs {b}"
    for r, other in enumerate(results[case.name][1:], start=1):
        assert other["grad_norms"] == results[case.name][0]["grad_norms"], f"rank {r} disagrees with rank 0"


@pytest.mark.parametrize("case", [c for c in CASES if c.overflow_step is not None], ids=lambda c: c.name)
def test_fp16_overflow_skips_exactly_that_step(world_results: tuple[int, dict], case: Case) -> None:
    _, results = world_results
    for per_rank in results[case.name]:
        assert per_rank["skipped"] == [step == case.overflow_step for step in range(case.steps)]


def test_stage2_shards_optimizer_states(world_results: tuple[int, dict]) -> None:
    world, results = world_results
    full = results["s0-fp32"][0]["optimizer_state_bytes"]
    for name in ("s1-fp32", "s2-fp32"):
        assert [r["optimizer_state_bytes"] * world for r in results[name]] == [full] * world


def test_collective_counts(world_results: tuple[int, dict]) -> None:
    """Per step: stage 2 reduce-scatters and all-gathers each unit once; stages 0-1 all-reduce;
    stage 3 gathers each block once in forward and again in backward unless the forward kept it
    gathered for the backward (runtime/prefetch.py `kept_for_backward`: here all three blocks fit the
    default prefetch budget; without prefetch only the last), the resident root once (refreshed after
    the optimizer step), and reduce-scatters every unit once per micro-step."""
    world, results = world_results
    units = 4  # 3 blocks + the root unit
    s2 = results["s2-fp32"][0]["collectives_last_step"]
    assert s2.get("reduce_scatter") == units and s2.get("all_gather") == units
    s0 = results["s0-fp32"][0]["collectives_last_step"]
    assert "reduce_scatter" not in s0 and "all_gather" not in s0
    # with accumulation and no per-micro-step sync, still one reduction per unit per step
    acc = results["s2-fp32-accum2"][0]["collectives_last_step"]
    assert acc.get("reduce_scatter") == units
    sync = results["s2-fp32-accum2-sync"][0]["collectives_last_step"]
    assert sync.get("reduce_scatter") == 2 * units
    blocks = units - 1
    s3 = results["s3-fp32"][0]["collectives_last_step"]
    assert s3.get("all_gather") == blocks + 1 and s3.get("reduce_scatter") == units
    s3acc = results["s3-fp32-accum2"][0]["collectives_last_step"]
    assert s3acc.get("all_gather") == 2 * blocks + 1 and s3acc.get("reduce_scatter") == 2 * units
    s3p0 = results["s3-fp32-prefetch0"][0]["collectives_last_step"]
    assert s3p0.get("all_gather") == blocks + (blocks - 1) + 1 and s3p0.get("reduce_scatter") == units
