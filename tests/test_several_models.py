"""Several sharded models in one process, and a model with nothing to train.

A DPO policy beside its frozen reference model, a student beside its teacher, a frozen critic
whose gradients flow back into a trainable model: each is sharded by its own `zeroinf.shard`,
often with the same `nvme_dir`. World 2 (one spawned group), every case against plain PyTorch on the
whole batch (torch's fused AdamW, the kernel zeroinf.AdamW runs):
- a trainable model A feeding a frozen model B, the loss on B's output, at stages 0-3 and parameter
  and optimizer tiers device / host / NVMe: the same losses, A's weights within 1e-6, B's weights
  and outputs unchanged and bitwise equal;
- a DPO step with two Hugging Face Llamas on NVMe in one folder, built eagerly, in one
  `zeroinf.init()` block, or in one block each: the same losses and weights, the reference model's
  generation equal to plain `generate`; each model has its own swap files (`model1` in the second
  one's names), all removed once the engines close.
- a GAN (two trainable models, each with its own optimizer; the generator's backward runs through
  the discriminator, whose gradients its `zero_grad()` then discards) with
  `offload.step_in_backward = false`, at stages 0, 2 and 3: the same losses and weights. (With the
  default in-backward step the discarding `zero_grad()` is refused, naming that setting.)
In process: `zeroinf.AdamW` refuses a model with nothing to train; model indices are claimed lowest
first per folder, rank and role; two models built in one `zeroinf.init()` block and sharded one
after the other are both bitwise their eager selves (the first `shard` used to drop the second
model's parked parameters, which then trained from uninitialized memory).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroinf
from tests._harness import run_ranks
from zeroinf.tiers.nvme import ModelIndex

GLOBAL_BATCH = 4
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, d), nn.Linear(d, 8)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _offload(placement: str, folder: str) -> zeroinf.OffloadConfig:
    params, optimizer = placement.split("/")
    return zeroinf.OffloadConfig(params=params, optimizer=optimizer, nvme_dir=folder)


def _rank_rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per]


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world


def _max_diff(state: dict[str, torch.Tensor], plain: nn.Module) -> float:
    return max((state[k].float() - v).abs().max().item() for k, v in plain.state_dict().items())


def _through_frozen(rank: int, world: int, stage: int, placement: str, folder: str) -> dict[str, Any]:
    torch.manual_seed(0)
    a, b = Net(), Net().requires_grad_(False)
    plain_a, plain_b = copy.deepcopy(a), copy.deepcopy(b)
    plain_opt = torch.optim.AdamW(plain_a.parameters(), lr=1e-3, fused=True)

    def cfg() -> zeroinf.Config:
        return zeroinf.Config(
            stage=stage, persist_threshold_bytes=0, unit_classes=["Block"], offload=_offload(placement, folder)
        )

    a, b = zeroinf.shard(a, cfg()), zeroinf.shard(b, cfg())
    opt = zeroinf.AdamW(a, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
        loss = ((b(a(_rank_rows(x, rank, world))) - _rank_rows(y, rank, world)) ** 2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        plain_loss = ((plain_b(plain_a(x)) - y) ** 2).mean()
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        losses.append((_mean_over_ranks(loss, world), plain_loss.item()))
    with torch.no_grad():
        outputs_equal = torch.equal(b(_rank_rows(x, rank, world)), plain_b(_rank_rows(x, rank, world)))
    out = {
        "losses": losses, "a_diff": _max_diff(a.state_dict(), plain_a), "b_diff": _max_diff(b.state_dict(), plain_b),
        "b_outputs_equal": outputs_equal, "b_trainable_units": len(zeroinf.engine_of(b).units),
    }
    opt.close()
    for model in (a, b):
        zeroinf.engine_of(model).close()
    return out


def _llama(seed: int) -> nn.Module:
    from tests._hf import build

    return build("llama", seed)


def _sequence_logp(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, x[:, 1:, None]).squeeze(-1).sum(-1)


def _dpo_loss(policy: nn.Module, reference: nn.Module, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():  # see tests/runtime/test_inference_mode.py
        ref_chosen, ref_rejected = _sequence_logp(reference, chosen), _sequence_logp(reference, rejected)
    margin = (_sequence_logp(policy, chosen) - ref_chosen) - (_sequence_logp(policy, rejected) - ref_rejected)
    return -F.logsigmoid(0.1 * margin).mean()


def _dpo(rank: int, world: int, build: str, folder: str) -> dict[str, Any]:
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder)

    def cfg() -> zeroinf.Config:
        return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)

    plain_policy, plain_reference = _llama(0), _llama(1).requires_grad_(False)
    if build == "eager":
        policy, reference = _llama(0), _llama(1)
    elif build == "one init block":
        with zeroinf.init(cfg()):
            policy, reference = _llama(0), _llama(1)
    else:
        with zeroinf.init(cfg()):
            policy = _llama(0)
        with zeroinf.init(cfg()):
            reference = _llama(1)
    reference.requires_grad_(False)
    policy, reference = zeroinf.shard(policy, cfg()), zeroinf.shard(reference, cfg())
    opt = zeroinf.AdamW(policy, lr=1e-3)
    plain_opt = torch.optim.AdamW(plain_policy.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(STEPS):
        chosen, rejected = (torch.randint(0, 128, (GLOBAL_BATCH, 16), generator=g) for _ in range(2))
        loss = _dpo_loss(policy, reference, _rank_rows(chosen, rank, world), _rank_rows(rejected, rank, world))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        plain_loss = _dpo_loss(plain_policy, plain_reference, chosen, rejected)
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        losses.append((_mean_over_ranks(loss, world), plain_loss.item()))
    files_while_training = sorted(n for n in os.listdir(folder) if n.startswith(f"zeroinf-rank{rank}-"))
    with torch.no_grad():
        prompt = chosen[rank : rank + 1, :5]
        generated = reference.generate(prompt, max_new_tokens=6, do_sample=False)
        plain_generated = plain_reference.generate(prompt, max_new_tokens=6, do_sample=False)
    out = {
        "losses": losses, "policy_diff": _max_diff(policy.state_dict(), plain_policy),
        "reference_diff": _max_diff(reference.state_dict(), plain_reference),
        "generation_equal": torch.equal(generated, plain_generated), "files": files_while_training,
    }
    opt.close()
    for model in (policy, reference):
        zeroinf.engine_of(model).close()
    dist.barrier()
    out["files_after_close"] = sorted(n for n in os.listdir(folder) if n.startswith("zeroinf-"))
    return out


def _gan_iteration(
    gen: nn.Module, disc: nn.Module, gen_opt: Any, disc_opt: Any, real: torch.Tensor, z: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    bce = nn.BCEWithLogitsLoss()
    disc_opt.zero_grad()
    fake = gen(z).detach()
    disc_loss = bce(disc(real), torch.ones(len(real), 1)) + bce(disc(fake), torch.zeros(len(fake), 1))
    disc_loss.backward()
    disc_opt.step()
    gen_opt.zero_grad()  # the generator's loss backpropagates through disc: those gradients are discarded
    gen_loss = bce(disc(gen(z)), torch.ones(len(z), 1))
    gen_loss.backward()
    gen_opt.step()
    return disc_loss, gen_loss


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
    disc = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return gen, disc


def _gan(rank: int, world: int, stage: int, placement: str, folder: str) -> dict[str, Any]:
    gen, disc = _gan_models()
    plain = copy.deepcopy(gen), copy.deepcopy(disc)
    plain_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in plain]
    offload = dataclasses.replace(_offload(placement, folder), step_in_backward=False)

    def cfg() -> zeroinf.Config:
        return zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload)

    gen, disc = zeroinf.shard(gen, cfg()), zeroinf.shard(disc, cfg())
    gen_opt, disc_opt = zeroinf.AdamW(gen, lr=1e-2), zeroinf.AdamW(disc, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        real, z = torch.randn(GLOBAL_BATCH, 8, generator=g) + 2, torch.randn(GLOBAL_BATCH, 8, generator=g)
        ours = _gan_iteration(gen, disc, gen_opt, disc_opt, _rank_rows(real, rank, world), _rank_rows(z, rank, world))
        theirs = _gan_iteration(*plain, *plain_opts, real, z)
        losses += [(_mean_over_ranks(a, world), b.item()) for a, b in zip(ours, theirs, strict=True)]
    out = {
        "losses": losses,
        "diff": max(_max_diff(gen.state_dict(), plain[0]), _max_diff(disc.state_dict(), plain[1])),
    }
    for opt, model in ((gen_opt, gen), (disc_opt, disc)):
        opt.close()
        zeroinf.engine_of(model).close()
    return out


THROUGH_FROZEN = [(0, "device/device"), (2, "device/host"), (3, "device/device"), (3, "host/host"), (3, "nvme/nvme")]
DPO_BUILDS = ["eager", "one init block", "two init blocks"]
GAN = [(0, "device/device"), (2, "device/host"), (3, "nvme/nvme")]


def run(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage, placement in THROUGH_FROZEN:
        folder = os.path.join(root, f"through-{stage}-{placement.replace('/', '-')}")
        os.makedirs(folder, exist_ok=True)
        out[f"through {stage} {placement}"] = _through_frozen(rank, world, stage, placement, folder)
    for build in DPO_BUILDS:
        folder = os.path.join(root, f"dpo-{build.replace(' ', '-')}")
        os.makedirs(folder, exist_ok=True)
        out[f"dpo {build}"] = _dpo(rank, world, build, folder)
    for stage, placement in GAN:
        folder = os.path.join(root, f"gan-{stage}-{placement.replace('/', '-')}")
        os.makedirs(folder, exist_ok=True)
        out[f"gan {stage} {placement}"] = _gan(rank, world, stage, placement, folder)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-several-") as root:
        return run_ranks(run, 2, root, timeout_s=300)


def _losses_match(losses: list[tuple[float, float]]) -> bool:
    return all(abs(ours - plain) <= 1e-6 * max(1.0, abs(plain)) for ours, plain in losses)


@pytest.mark.parametrize(("stage", "placement"), THROUGH_FROZEN)
def test_gradients_flow_through_a_frozen_sharded_model(
    results: list[dict[str, Any]], stage: int, placement: str
) -> None:
    for rank, r in enumerate(results):
        case = r[f"through {stage} {placement}"]
        assert _losses_match(case["losses"]), (rank, case["losses"])
        assert case["a_diff"] <= 1e-6, (rank, case["a_diff"])
        assert case["b_diff"] == 0.0 and case["b_outputs_equal"], (rank, case)
        assert case["b_trainable_units"] == 0


@pytest.mark.parametrize("build", DPO_BUILDS)
def test_policy_and_frozen_reference_share_a_folder(results: list[dict[str, Any]], build: str) -> None:
    for rank, r in enumerate(results):
        case = r[f"dpo {build}"]
        assert _losses_match(case["losses"]), (rank, case["losses"])
        assert case["policy_diff"] <= 1e-6, (rank, case["policy_diff"])
        assert case["reference_diff"] == 0.0 and case["generation_equal"], (rank, case)
        prefix = f"zeroinf-rank{rank}-"
        assert f"{prefix}param_shard.swap" in case["files"], case["files"]
        assert f"{prefix}model1-param_shard.swap" in case["files"], case["files"]
        assert case["files_after_close"] == [], case["files_after_close"]


@pytest.mark.parametrize(("stage", "placement"), GAN)
def test_a_gan_discards_the_discriminator_gradients_of_the_generator_step(
    results: list[dict[str, Any]], stage: int, placement: str
) -> None:
    for rank, r in enumerate(results):
        case = r[f"gan {stage} {placement}"]
        assert _losses_match(case["losses"]), (rank, case["losses"])
        assert case["diff"] <= 1e-6, (rank, case["diff"])


def test_discarding_gradients_after_an_in_backward_step_names_the_setting() -> None:
    gen, disc = _gan_models()
    gen, disc = zeroinf.shard(gen, zeroinf.Config(stage=3)), zeroinf.shard(disc, zeroinf.Config(stage=3))
    gen_opt, disc_opt = zeroinf.AdamW(gen, lr=1e-2), zeroinf.AdamW(disc, lr=1e-2)
    real, z = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="step_in_backward = false to be able to discard gradients"):
        _gan_iteration(gen, disc, gen_opt, disc_opt, real, z)
        _gan_iteration(gen, disc, gen_opt, disc_opt, real, z)
    for opt, model in ((gen_opt, gen), (disc_opt, disc)):
        opt.close()
        zeroinf.engine_of(model).close()


def test_adamw_refuses_a_model_with_nothing_to_train() -> None:
    model = zeroinf.shard(Net().requires_grad_(False), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    with pytest.raises(ValueError, match="no trainable parameters.*needs no optimizer"):
        zeroinf.AdamW(model)
    assert model(torch.randn(2, 8)).shape == (2, 8)  # it still runs forward
    zeroinf.engine_of(model).close()


def test_model_indices_are_claimed_lowest_first_per_folder_rank_and_role(tmp_path: Any) -> None:
    first, second = ModelIndex(str(tmp_path), 0, "tier"), ModelIndex(str(tmp_path), 0, "tier")
    other_rank, park = ModelIndex(str(tmp_path), 1, "tier"), ModelIndex(str(tmp_path), 0, "park")
    assert (first.index, second.index, other_rank.index, park.index) == (0, 1, 0, 0)
    first.release()
    third = ModelIndex(str(tmp_path), 0, "tier")
    assert third.index == 0  # the lowest free one: a crashed run's second model's files get replaced
    first.release()  # a second release must not free index 0, which `third` holds now
    assert ModelIndex(str(tmp_path), 0, "tier").index == 2
    for claimed in (second, third, other_rank, park):
        claimed.release()


def test_a_release_from_inside_a_claim_does_not_wait_for_itself(tmp_path: Any) -> None:
    """A dead engine's finalizer gives its index back from whatever the thread is doing when the garbage
    collector runs, also from inside another model's claim, which holds the lock: that must not hang."""
    from zeroinf.tiers import nvme

    dead = ModelIndex(str(tmp_path), 0, "tier")

    def finalizer_inside_a_claim() -> None:
        with nvme._model_indices_lock:  # as ModelIndex.__init__ holds it
            dead.release()

    thread = threading.Thread(target=finalizer_inside_a_claim, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "release waited for the lock its own thread holds"
    assert ModelIndex(str(tmp_path), 0, "tier").index == 0  # given back


@pytest.mark.parametrize("params", ["host", "nvme"])
def test_two_models_built_in_one_init_block_are_both_their_eager_selves(tmp_path: Any, params: str) -> None:
    def cfg() -> zeroinf.Config:
        offload = zeroinf.OffloadConfig(params=params, nvme_dir=str(tmp_path))
        return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)

    eager = [_llama(0).state_dict(), _llama(1).state_dict()]
    with zeroinf.init(cfg()):
        built = [_llama(0), _llama(1)]
    for model, expected in zip(built, eager, strict=True):
        sharded = zeroinf.shard(model, cfg())
        state = sharded.state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected.items())
        zeroinf.engine_of(sharded).close()
