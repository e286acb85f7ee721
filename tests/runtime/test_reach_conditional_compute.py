"""Parameters whose gradients reach some ranks only: a mixture of experts with one module per
expert, where each rank's tokens go to some experts, and LayerDrop, where a rank skips whole layers.

Before runtime/reach.py [Note: gradients that reach some ranks only], the ranks issued their gradient
collectives in different orders there (gloo aborted the process: "Received data size doesn't match
expected size"), at every stage. World 2, one spawned group, against plain PyTorch on the same
per-rank batches (the loss is the mean of the ranks' losses, as data parallelism computes it, and
`zero_grad` sets gradients to None, so an expert no rank used this step is skipped by the step,
moments included): weights within 1e-6 after every schedule of routes below.

The routes are inputs, so every case of the rule holds on some step: an expert one rank uses and the
other does not, an expert neither uses, every expert on both, and a layer one rank skips (the first,
the last) or both skip; also with `activation_checkpointing` (non-reentrant: the parameters are
reachable when backward starts). Hugging Face's Switch Transformer (one module per expert, a learned
router) at stages 0 and 3 on NVMe: within 1e-5 (fp32 T5 arithmetic over 4 steps; 9.8e-7 measured).
Not covered: per-expert modules inside a reentrant checkpoint (`use_reentrant=True`), reached only
in a nested backward.

Stage 3 with a layer skipped on one rank cannot work (every rank must gather the same units in
forward). Hugging Face's LayerDrop encoders run every layer when they see the flag `zeroinf.shard`
sets on every submodule at stage 3: wav2vec2 with LayerDrop 0.9, drawn differently on each rank,
trains at stage 3 as the plain model without LayerDrop (within 1e-6; with the flag on the root only,
the ranks hung in their first forward).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests._parity import max_diff_then_close

DIM, EXPERTS, LAYERS, TOKENS = 8, 4, 3, 6

# Per step, per rank: the expert every token of that rank goes to, in every layer.
ROUTES = [
    [(0, 1), (1, 2)],  # 0 and 2 on one rank only, 3 on neither
    [(0, 1, 2, 3), (0,)],  # 1, 2 and 3 on rank 0 only
    [(0, 1, 2, 3), (3, 2, 1, 0)],  # every expert on both
    [(3,), (3,)],  # 0, 1 and 2 on neither: their unit waits for the end of backward
    [(2,), (0,)],
]
# Per step, per rank: the layers skipped.
SKIPS = [[(1,), ()], [(), (LAYERS - 1,)], [(0,), (0,)], [(), ()], [(0, 2), (2,)]]


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-1 routing given as input (`route[t]`: token t's expert), weighted by the learned router."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router = nn.LayerNorm(DIM), nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        weight = self.router(h).softmax(-1).gather(-1, route.unsqueeze(-1))
        out = torch.zeros_like(x)
        for e in route.unique().tolist():
            rows = route == e
            out[rows] = self.experts[e](h[rows]) * weight[rows]
        return x + out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)
        self.layers = nn.ModuleList(MoELayer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, route: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i not in skip:
                h = layer(h, route)
        return self.head(h).pow(2).mean()


def _route(experts: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([experts[t % len(experts)] for t in range(TOKENS)])


def _case(
    rank: int, world: int, stage: int, tier: str, folder: str, layerdrop: bool, accum: int, checkpointing: bool
) -> float:
    torch.manual_seed(0)
    plain = Net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=folder) if tier != "device" else None
    cfg = zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, unit_classes=[MoELayer], grad_accum_steps=accum,
        offload=offload or zeroinf.OffloadConfig(), activation_checkpointing=checkpointing,
    )
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    schedule = [(routes, skips if layerdrop else [(), ()]) for routes, skips in zip(ROUTES, SKIPS, strict=True)]
    for step in range(0, len(schedule) - len(schedule) % accum, accum):
        for routes, skips in schedule[step : step + accum]:
            x = torch.randn(world, TOKENS, DIM, generator=g)
            loss = sum(plain(x[r], _route(routes[r]), skips[r]) for r in range(world)) / (world * accum)
            loss.backward()
            (model(x[rank], _route(routes[rank]), skips[rank]) / accum).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


CASES = [
    # (stage, tier, layerdrop, grad_accum_steps, activation_checkpointing)
    (0, "device", False, 1, False), (1, "device", False, 1, False), (2, "device", False, 1, False),
    (3, "device", False, 1, False), (3, "host", False, 1, False), (3, "nvme", False, 1, False),
    (1, "device", False, 2, False), (3, "nvme", False, 2, False), (3, "device", False, 1, True),
    (0, "device", True, 1, False), (1, "device", True, 1, False), (2, "device", True, 1, False),
    (2, "device", True, 2, False), (2, "device", True, 1, True),
]


def _switch(seed: int = 0) -> nn.Module:
    """Hugging Face's Switch Transformer (an encoder-decoder whose every feed-forward is a top-1
    mixture of one module per expert), tiny, deterministic routing (no jitter, no dropout)."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1,
        router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )
    return SwitchTransformersForConditionalGeneration(cfg)


def _switch_case(rank: int, world: int, stage: int, tier: str, folder: str) -> float:
    """One sequence of 6 tokens per rank and step: some of the 4 experts of a layer get none of them."""
    plain = _switch()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=folder) if tier != "device" else None
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload or zeroinf.OffloadConfig())
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randint(1, 128, (world, 6), generator=g), torch.randint(1, 128, (world, 5), generator=g)
        (sum(plain(input_ids=x[r : r + 1], labels=y[r : r + 1]).loss for r in range(world)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model(input_ids=x[rank : rank + 1], labels=y[rank : rank + 1]).loss.backward()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


SWITCH_CASES = [(0, "device"), (3, "nvme")]


def _wav2vec2(layerdrop: float) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(
        vocab_size=12, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, layerdrop=layerdrop, mask_time_prob=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, pad_token_id=0,
    )
    return Wav2Vec2ForCTC(cfg)


def _wav2vec2_case(rank: int, world: int) -> float:
    """Stage 3, LayerDrop 0.9 drawn differently on each rank: the encoder runs every layer (it sees
    the FSDP flag on itself), so it trains as the plain model without LayerDrop. Without the flag on
    the encoder (only on the root), the ranks hung in their first forward."""
    plain = _wav2vec2(0.0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    model = zeroinf.shard(_wav2vec2(0.9), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(world, 400, generator=g), torch.randint(1, 12, (world, 3), generator=g)
        (sum(plain(x[r : r + 1], labels=y[r : r + 1]).loss for r in range(world)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model(x[rank : rank + 1], labels=y[rank : rank + 1]).loss.backward()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


def run(rank: int, world: int, root: str) -> dict[str, float]:
    out = {}
    for case in CASES:
        folder = os.path.join(root, "-".join(map(str, case)))
        os.makedirs(folder, exist_ok=True)
        out[str(case)] = _case(rank, world, case[0], case[1], folder, *case[2:])
    for stage, tier in SWITCH_CASES:
        folder = os.path.join(root, f"switch-{stage}-{tier}")
        os.makedirs(folder, exist_ok=True)
        out[f"switch {stage} {tier}"] = _switch_case(rank, world, stage, tier, folder)
    out["wav2vec2"] = _wav2vec2_case(rank, world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-conditional-") as root:
        return run_ranks(run, 2, root, timeout_s=300)


IDS = [f"stage{s}-{t}-{'layerdrop' if d else 'moe'}-accum{a}{'-checkpointing' if c else ''}" for s, t, d, a, c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients_on_some_ranks_only_match_plain_pytorch(results: list[dict[str, float]], case: tuple) -> None:
    for rank, r in enumerate(results):
        assert r[str(case)] <= 1e-6, (rank, r)


@pytest.mark.parametrize(("stage", "tier"), SWITCH_CASES)
def test_hugging_face_switch_transformer_matches_plain_pytorch(
    results: list[dict[str, float]], stage: int, tier: str
) -> None:
    for rank, r in enumerate(results):
        assert r[f"switch {stage} {tier}"] <= 1e-5, (rank, r)


def test_hugging_face_layerdrop_encoder_runs_every_layer_at_stage_3(results: list[dict[str, float]]) -> None:
    for rank, r in enumerate(results):
        assert r["wav2vec2"] <= 1e-6, (rank, r)


def test_the_routes_cover_every_case_of_the_rule() -> None:
    """Each kind of step the rule distinguishes occurs in the schedule above."""
    used = [[set(r) for r in routes] for routes in ROUTES]
    everywhere = set(range(EXPERTS))
    assert any((a | b) - (a & b) for a, b in used)  # an expert on one rank only
    assert any(everywhere - (a | b) for a, b in used)  # an expert on neither
    assert any(a == b == everywhere for a, b in used)
    skipped = [[set(s) for s in skips] for skips in SKIPS]
    assert any((a | b) - (a & b) for a, b in skipped)  # a layer skipped on one rank only
    assert any(a & b for a, b in skipped)  # a layer skipped on both
    assert any(LAYERS - 1 in (a | b) - (a & b) for a, b in skipped) and any(0 in a ^ b for a, b in skipped)


def _marked(rank: int, world: int) -> list[bool]:
    from transformers.distributed.fsdp import is_fsdp_managed_module

    torch.manual_seed(0)
    sharded = zeroinf.shard(Net(), zeroinf.Config(stage=3, unit_classes=[MoELayer]))
    data_parallel = zeroinf.shard(Net(), zeroinf.Config(stage=2, unit_classes=[MoELayer]))
    out = [all(is_fsdp_managed_module(m) for m in sharded.modules()),
           any(is_fsdp_managed_module(m) for m in data_parallel.modules())]
    for m in (sharded, data_parallel):
        zeroinf.engine_of(m).close()
    return out


def test_stage_3_marks_every_submodule_for_hugging_face_where_ranks_must_keep_in_step() -> None:
    """Hugging Face's LayerDrop encoders (wav2vec2, HuBERT, ...) and `generate` ask
    `is_fsdp_managed_module(self)` whether every rank must run every layer and forward pass: so at
    stage 3 with other ranks. Not at stages 0-2 (LayerDrop works there), nor in a process alone:
    Seq2SeqTrainer passes `synced_gpus=True` for a marked model whatever the world, and generate's
    first all-reduce stopped a single process without a process group."""
    assert run_ranks(_marked, 2)[0] == [True, False]
    assert _marked(0, 1) == [False, False]
