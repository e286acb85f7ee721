"""ZeRO stage 3 on Hugging Face models (GPT-2, Llama) built from tiny configs: training parity with plain
PyTorch, the module keeps its class and `state_dict` keys, the units found, and greedy `.generate()`
under no_grad in the middle of training (on-demand fetching, identical tokens, the trace survives).

One spawned group per world size runs every case (tests/_hf.py); the single-process reference runs
once per case in the test process. World 4 is marked slow: importing transformers costs each rank
several CPU-seconds, too much for two shared cores in the default run (`pytest -m slow` runs it).

Tolerances are those of tests/test_parity.py (fp32: rtol 1e-5 / atol 5e-5; bf16: 2e-2 relative on
losses, 0.5 * lr * steps on weights), with one exception: the key third of GPT-2's fused
`c_attn.bias`. Softmax is shift-invariant, so the key bias has an exactly-zero gradient; what autograd
computes is rounding noise, which Adam normalizes into updates of up to lr per step whose signs depend
on the summation order (per-rank bf16 slices at world 2 moved it 1.7e-2 in 8 steps). That slice is
only held to the bound Adam puts on any update (2 * lr * steps: both sides, at most ~lr per step).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests._harness import run_ranks
from tests._hf import NEW_TOKENS, PROMPT_LEN, PROMPTS_PER_RANK, Case, run_cases, train_reference
from tests._parity import LR

CASES = [
    Case("gpt2-s3-fp32-generate", "gpt2", generate_after=4),
    Case("gpt2-s3-bf16", "gpt2", dtype="bf16"),
    Case("llama-s3-fp32-generate", "llama", generate_after=4),
    Case("llama-s3-bf16", "llama", dtype="bf16"),
    Case("llama-tied-s3-fp32", "llama-tied"),
    Case("gpt2-s2-fp32", "gpt2", stage=2),
    Case("llama-s3-fp32-reentrant", "llama", steps=4, reentrant_checkpointing=True),
]
GENERATE_CASES = [c for c in CASES if c.generate_after is not None]
S3_CASES = [c for c in CASES if c.stage == 3]


def tolerances(case: Case) -> tuple[float, float]:  # (loss rtol, weight atol)
    return (1e-5, 5e-5) if case.dtype == "fp32" else (2e-2, 0.5 * LR * case.steps)


@functools.cache
def reference(case: Case, buffer_dtypes: tuple) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(case, buffer_dtypes)


WORLDS = [1, 2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_results(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[dict]]]:
    world = request.param
    per_rank = run_ranks(run_cases, world, CASES, timeout_s=300)
    return world, {case.name: [r[case.name] for r in per_rank] for case in CASES}


def _split_key_bias(name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GPT-2 `c_attn.bias` is [query | key | value]: the rest, and the key third (None elsewhere)."""
    if not name.endswith("attn.c_attn.bias"):
        return t, None
    q, k, v = t.chunk(3)
    return torch.cat([q, v]), k


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_plain_pytorch(world_results: tuple[int, dict], case: Case) -> None:
    world, results = world_results
    ours = results[case.name][0]
    ref_losses, ref_weights = reference(case, ours["buffer_dtypes"])
    loss_rtol, weight_atol = tolerances(case)
    for step, (a, b) in enumerate(zip(ours["losses"], ref_losses, strict=True)):
        assert a == pytest.approx(b, rel=loss_rtol), f"{case.name} world {world}: step {step}: {a} vs {b}"
    assert set(ours["weights"]) == set(ref_weights)
    for name, ref in ref_weights.items():
        mine, ref_rest = _split_key_bias(name, ours["weights"][name]), _split_key_bias(name, ref)
        torch.testing.assert_close(
            mine[0], ref_rest[0], rtol=loss_rtol if case.dtype == "fp32" else 0, atol=weight_atol,
            msg=lambda m, name=name: f"{case.name} world {world}: weight {name}: {m}",
        )
        if ref_rest[1] is not None:
            key_diff = (mine[1] - ref_rest[1]).abs().max().item()
            assert key_diff <= 2 * LR * case.steps, f"{case.name} world {world}: {name} key: {key_diff}"
    for r, other in enumerate(results[case.name][1:], start=1):
        assert other["losses"] == pytest.approx(ours["losses"]), f"{case.name}: rank {r} disagrees"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_module_keeps_its_class_names_and_ties(world_results: tuple[int, dict], case: Case) -> None:
    _, results = world_results
    ours = results[case.name][0]
    assert ours["class_kept"]
    assert ours["state_dict_keys"] == ours["keys_expected"]
    assert ours["tied"] == (case.arch in ("gpt2", "llama-tied"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_units_are_the_decoder_blocks(world_results: tuple[int, dict], case: Case) -> None:
    """Each block of the repeated ModuleList is a unit; at stage 3 so are the untied embeddings and
    head (`Config.split_root`), and the final norm forms the root (a tied head is the embedding's
    parameter: owned once, by the root, under the embedding's name)."""
    _, results = world_results
    ours = results[case.name][0]
    split = case.stage == 3
    if case.arch == "gpt2":  # wte is tied to the head; wpe is read by its own forward
        wpe = ["transformer.wpe"] if split else []
        assert ours["units"] == [*wpe, "transformer.h.0", "transformer.h.1", "<root>"]
        assert ours["root_params"] == [
            "transformer.wte.weight", *([] if split else ["transformer.wpe.weight"]),
            "transformer.ln_f.weight", "transformer.ln_f.bias",
        ]
    elif case.arch == "llama-tied" or not split:
        assert ours["units"] == ["model.layers.0", "model.layers.1", "<root>"]
        head = [] if case.arch == "llama-tied" else ["lm_head.weight"]
        assert ours["root_params"] == ["model.embed_tokens.weight", "model.norm.weight", *head]
    else:
        assert ours["units"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head", "<root>"]
        assert ours["root_params"] == ["model.norm.weight"]


def _sharded_units(ours: dict) -> int:
    """Stage 3: every unit but the root is sharded (persist_threshold_bytes=0)."""
    return len(ours["units"]) - 1


@pytest.mark.parametrize("case", GENERATE_CASES, ids=lambda c: c.name)
def test_generate_under_stage3(world_results: tuple[int, dict], case: Case) -> None:
    """Greedy generation before training and after `generate_after` steps, on every rank with its own
    prompts and no `synced_gpus` argument: the tokens (and a no-grad forward's logits) equal a plain
    model's with the gathered weights; the first no-grad pass records an inference trace on demand,
    the next ones prefetch along it, each block is gathered once per pass and released after it, and
    the training trace is left alone."""
    world, results = world_results
    for rank, per_rank in enumerate(results[case.name]):
        assert len(per_rank["generations"]) == 2
        n_units = _sharded_units(per_rank)
        whens = ("before training", f"after {case.generate_after} steps")
        for when, gen in zip(whens, per_rank["generations"], strict=True):
            where = f"{case.name} world {world} rank {rank} {when}"
            assert gen["ours"].shape == (PROMPTS_PER_RANK, PROMPT_LEN + NEW_TOKENS), where
            assert torch.equal(gen["ours"], gen["theirs"]), f"{where}: {gen['ours']} vs {gen['theirs']}"
            assert gen["logit_diff"] <= 1e-6, where
            assert gen["inference_trace_state"] == "following" and gen["inference_planned"], where
            if when == "before training":  # the first pass records on demand: one unit at a time
                assert gen["live_blocks"][:n_units] == [1] * n_units, where
            # later passes prefetch along the trace: the test's units all fit the prefetch budget
            assert gen["peak_live_blocks"] == n_units, where
            assert gen["trace_state"] != "departed", where  # the training trace is left alone
            assert gen["gathers"] == gen["expected_gathers"], where
            assert gen["still_unsharded"] == [], where
            assert gen["plan_kept"] and gen["departures_delta"] == 0, where


@pytest.mark.parametrize("case", S3_CASES, ids=lambda c: c.name)
def test_training_trace_survives_generation(world_results: tuple[int, dict], case: Case) -> None:
    """Every training step after the first follows the recorded trace (with or without a generation in
    between): no departures, the prefetch plan runs (every sharded unit live once the first starts:
    they fit the budget), and every step issues the same collectives."""
    world, results = world_results
    for rank, per_rank in enumerate(results[case.name]):
        where = f"{case.name} world {world} rank {rank}"
        assert per_rank["departures"] == [0] * case.steps, where
        assert per_rank["trace_states"] == ["recording"] + ["following"] * (case.steps - 1), where
        n_units = _sharded_units(per_rank)
        assert per_rank["train_peak_live_blocks"][1:] == [n_units] * (case.steps - 1), where
        collectives = per_rank["collectives"]
        assert all(c == collectives[1] for c in collectives[1:]), f"{where}: {collectives}"
        # each sharded unit gathered in forward and kept for the backward (all fit the prefetch budget:
        # runtime/prefetch.py `kept_for_backward`), the root once (refreshed after the step)
        assert collectives[1].get("all_gather") == n_units + 1, where
        assert collectives[1].get("reduce_scatter") == n_units + 1, where
