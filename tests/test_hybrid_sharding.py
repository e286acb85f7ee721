"""Hybrid sharding (Config.shard_group_size; comm.py [Note: hybrid sharding]): four ranks in two
shard groups of two, {0, 1} and {2, 3}, replicated across them.

The reference is what hybrid sharding promises, in plain PyTorch: `DistributedDataParallel` over
each pair (`process_group=` the shard group) and, after backward, every gradient all-reduced across
the pairs and halved, fused AdamW. zeroinf at stages 0, 1, 2 and 3 (stage 3 with its shards and
states on the host and on NVMe, gradients on NVMe, activation checkpointing; stages 1-2 also
accumulating two micro-steps; bf16 at stages 2 and 3) trains bitwise that (with clipping, to rounding):
the mean loss over the four ranks and every rank's weights, so both groups hold the same model. Each
rank builds its model from another seed: `shard` gives every rank the first rank's weights. And a
blocking checkpoint is written by the first group alone (its rank files only) and loads in both.
Against DDP over all four ranks (another summation order) the weights agree to float rounding. A
model whose groups route to different experts (a unit one group's backward never reaches) trains
bitwise DDP with `find_unused_parameters` over each pair, averaged across the pairs with zeros where
a pair did not use a parameter: the agreement on what a backward reaches runs over the world. Built
under `zeroinf.init`, and edited under `gathered` by one rank, every rank holds the same model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks
from tests._parity import LR, Case, build_model, micro_batches, rank_mean, train_data_parallel_with_masters

WORLD, SIZE = 4, 2
CASES = [
    Case("s0", 0, steps=4),
    Case("s1-accum2", 1, accum=2, steps=4),
    Case("s2", 2, steps=4),
    Case("s2-accum2", 2, accum=2, steps=4),
    Case("s3", 3, steps=4),
    Case("s3-host", 3, steps=4, overrides=(("offload", {"params": "host", "optimizer": "host"}),)),
    Case("s3-nvme", 3, steps=4, overrides=(("offload", {"params": "nvme", "optimizer": "nvme"}),)),
    Case("s2-bf16", 2, dtype="bf16", steps=4),
    Case("s3-bf16-host", 3, dtype="bf16", steps=4, overrides=(("offload", {"params": "host", "optimizer": "host"}),)),
    Case("s3-grads-nvme", 3, steps=4, overrides=(("offload", {"optimizer": "host", "gradients": "nvme"}),)),
    Case("s3-checkpointing", 3, steps=4, overrides=(("activation_checkpointing", True),)),
]
CLIPPED = Case("s2-clip", 2, steps=4, clip=0.05)  # the norm is summed over shards: to rounding


def _offload(case: Case, folder: str) -> Any:
    import zeroinf

    return zeroinf.OffloadConfig(**dict(case.overrides).get("offload", {}), nvme_dir=folder)


def _zeroinf(case: Case, rank: int, folder: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    import zeroinf

    fields = {k: v for k, v in case.overrides if k != "offload"}
    cfg = zeroinf.Config(
        stage=case.stage, param_dtype=case.dtype, grad_accum_steps=case.accum, shard_group_size=SIZE,
        persist_threshold_bytes=0, offload=_offload(case, folder), grad_clip_norm=case.clip, **fields,
    )
    model = zeroinf.shard(build_model(case.model, seed=100 + rank), cfg)  # another seed on each rank
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay)
    losses = []
    for step in range(case.steps):
        total = torch.zeros(())
        for x, y in micro_batches(case, rank, WORLD, step):
            loss = model(x, y) / case.accum
            total += loss.detach()
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(total, WORLD))
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    opt.close()
    zeroinf.engine_of(model).close()
    return losses, state


def _bf16_by_hand(case: Case, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """fp32 masters, a bf16 copy for forward and backward, its gradients widened to fp32, averaged
    over the pair, then across the pairs, fused AdamW on the masters (tests/_parity.py's
    `train_data_parallel_with_masters` in two rounds)."""
    from zeroinf.topology import hybrid_groups

    shard_group, replica_group = hybrid_groups(SIZE, WORLD)

    def in_two_rounds(grad: torch.Tensor) -> None:
        for group, size in ((shard_group, SIZE), (replica_group, WORLD // SIZE)):
            dist.all_reduce(grad, group=group)
            grad /= size

    out = train_data_parallel_with_masters(case, rank, WORLD, average=in_two_rounds, seed=100)
    return out["losses"], out["state"]


def _pairs_then_across(case: Case, rank: int, groups: bool = True) -> tuple[list[float], dict[str, torch.Tensor]]:
    """DDP over each pair, then the gradients averaged across the pairs (`groups`); or DDP over all four."""
    from torch.nn.parallel import DistributedDataParallel

    from zeroinf.topology import hybrid_groups

    shard_group, replica_group = hybrid_groups(SIZE, WORLD)
    model = build_model(case.model, seed=100)  # the first rank's seed
    ddp = DistributedDataParallel(model, process_group=shard_group if groups else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=case.weight_decay, fused=True)
    losses = []
    for step in range(case.steps):
        total = torch.zeros(())
        for m, (x, y) in enumerate(micro_batches(case, rank, WORLD, step)):
            last = m == case.accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(x, y) / case.accum
                loss.backward()
            total += loss.detach()
        if groups:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=replica_group)
                p.grad /= WORLD // SIZE
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(total, WORLD))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _checkpoint(rank: int, folder: str) -> dict[str, Any]:
    import zeroinf

    cfg = zeroinf.Config(stage=3, shard_group_size=SIZE, persist_threshold_bytes=0)
    case = CASES[4]
    model = zeroinf.shard(build_model(case.model, seed=100 + rank), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    x, y = micro_batches(case, rank, WORLD, 0)[0]
    opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()
    torch.manual_seed(1000 + rank)  # each rank's own random stream, saved with the checkpoint
    with contextlib.ExitStack() as patches:
        if rank >= SIZE:  # the second group must not write: a write there fails the test
            from unittest import mock

            patches.enter_context(mock.patch("zeroinf.checkpoint.saving._SaveJob", side_effect=AssertionError))
        saved = zeroinf.save(os.path.join(folder, "ckpt"), model, opt, step=1)
    draw = torch.rand(4)  # what this rank's stream gives next
    state = model.state_dict()
    files = sorted(os.listdir(saved))
    fresh = zeroinf.shard(build_model(case.model, seed=7), cfg)
    fresh_opt = zeroinf.AdamW(fresh, lr=LR)
    zeroinf.load(os.path.join(folder, "ckpt"), fresh, fresh_opt)
    resumed_draw = torch.rand(4)  # after the load: the same, on every rank of both groups
    loaded = fresh.state_dict()
    equal = all(torch.equal(loaded[k], v) for k, v in state.items())
    leads = zeroinf.engine_of(model).topo.leads  # who writes a Hugging Face folder (save_pretrained)
    for o, m in ((opt, model), (fresh_opt, fresh)):
        o.close()
        zeroinf.engine_of(m).close()
    return {"saved": saved, "files": files, "equal": equal, "leads": leads, "rng": torch.equal(draw, resumed_draw)}


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Routed(torch.nn.Module):
    """Two experts, each a unit of its own; the first group's tokens go to one, the second's to the other."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.experts = torch.nn.ModuleList([Expert(), Expert()])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.out(self.experts[expert](self.inp(x))).pow(2).mean()


def _routed(rank: int, by_hand: bool, stage: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each group routes to its own expert: a unit some ranks' backward never reaches. zeroinf agrees on
    it over the world (the unit reduces at the end of backward on every rank, zeros where unused);
    by hand: DDP over the pair (find_unused_parameters), then a gradient used anywhere is averaged
    across the pairs, zeros where a pair did not use it."""
    from torch.nn.parallel import DistributedDataParallel

    import zeroinf
    from tests._parity import rank_rows
    from zeroinf.topology import hybrid_groups

    torch.manual_seed(100 if by_hand else 100 + rank)
    model = Routed()
    if by_hand:
        shard_group, replica_group = hybrid_groups(SIZE, WORLD)
        ddp: Any = DistributedDataParallel(model, process_group=shard_group, find_unused_parameters=True)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    else:
        cfg = zeroinf.Config(stage=stage, shard_group_size=SIZE, persist_threshold_bytes=0)
        ddp = model = zeroinf.shard(model, cfg)
        opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
    losses = []
    for step in range(3):
        loss = ddp(rank_rows(step, rank, WORLD), rank // SIZE)
        if by_hand:
            loss.backward()
            for p in model.parameters():
                used = torch.tensor(float(p.grad is not None))
                dist.all_reduce(used, op=dist.ReduceOp.MAX)
                if used.item():
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad
                    dist.all_reduce(p.grad, group=replica_group)
                    p.grad /= WORLD // SIZE
        else:
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(rank_mean(loss.detach(), WORLD))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not by_hand:
        opt.close()
        zeroinf.engine_of(model).close()
    return losses, state


def _unseeded() -> torch.nn.Module:
    from tests._parity import TinyGPT

    return TinyGPT()


def _run(rank: int, world: int) -> dict[str, Any]:
    assert world == WORLD
    names = [tempfile.mkdtemp(prefix="zeroinf-hybrid-") if rank == 0 else ""]
    dist.broadcast_object_list(names, src=0)  # one folder for every rank (swap files carry the rank)
    out: dict[str, Any] = {}
    for case in CASES:
        folder = os.path.join(names[0], case.name)  # each case's swap files in a folder of its own
        os.makedirs(folder, exist_ok=True)
        out[case.name] = _zeroinf(case, rank, folder)
        out[f"{case.name}/ref"] = _bf16_by_hand(case, rank) if case.dtype == "bf16" else _pairs_then_across(case, rank)
    out["ddp-all-four"] = _pairs_then_across(CASES[4], rank, groups=False)
    clip_folder = os.path.join(names[0], CLIPPED.name)
    os.makedirs(clip_folder, exist_ok=True)
    out[CLIPPED.name] = _zeroinf(CLIPPED, rank, clip_folder)
    out[f"{CLIPPED.name}/ref"] = _pairs_then_across(CLIPPED, rank)
    out["routed"] = {"s3": _routed(rank, False), "s2": _routed(rank, False, stage=2), "ref": _routed(rank, True)}
    out["checkpoint"] = _checkpoint(rank, names[0])
    import zeroinf

    # built under zeroinf.init (the same seed on every rank, as it asks), then one rank's edit under `gathered`
    cfg = zeroinf.Config(stage=3, shard_group_size=SIZE, persist_threshold_bytes=0)
    torch.manual_seed(100)
    with zeroinf.init(cfg):
        model = _unseeded()  # the global seed of this rank
    model = zeroinf.shard(model, cfg)
    built = {k: v.clone() for k, v in model.state_dict().items()}
    with zeroinf.gathered(model.pos, modify=True, modifier_rank=1):
        model.pos.fill_(float(rank))
    out["init"] = (built, model.state_dict()["pos"].clone())
    zeroinf.engine_of(model).close()
    out["refused"] = []

    for bad in ({"shard_group_size": 3}, {"shard_group_size": 2, "group": True}):
        topology = zeroinf.Topology.current(dist.new_group([0, 1, 2, 3])) if bad.pop("group", False) else None
        try:
            zeroinf.shard(build_model(), zeroinf.Config(stage=3, **bad), topology)
        except ValueError as e:
            out["refused"].append(str(e))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(names[0], ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_run, WORLD, timeout_s=420)


def test_hybrid_sharding_trains_as_ddp_in_pairs_averaged_across(results: list[dict[str, Any]]) -> None:
    for rank, runs in enumerate(results):
        for case in CASES:
            losses, state = runs[case.name]
            ref_losses, ref_state = runs[f"{case.name}/ref"]
            start = build_model(case.model, seed=100).state_dict()["pos"]
            start = start.to(torch.bfloat16).float() if case.dtype == "bf16" else start
            assert not torch.equal(ref_state["pos"], start), "the reference must train"
            assert losses == ref_losses, (rank, case.name, losses, ref_losses)
            assert state.keys() == ref_state.keys()
            differs = [k for k, v in ref_state.items() if not torch.equal(state[k], v)]
            assert differs == [], (rank, case.name, differs)
    for case in CASES:  # both groups hold the same model
        first = results[0][case.name][1]
        assert all(torch.equal(first[k], v) for r in results for k, v in r[case.name][1].items()), case.name


def test_clipping_under_hybrid_sharding_clips_the_mean_over_every_rank(results: list[dict[str, Any]]) -> None:
    """Clipping (0.05, below every norm seen) scales the gradient averaged over all four ranks, as
    `clip_grad_norm_` after the average across the pairs does, to float rounding (the norm is summed
    over shards, not parameter by parameter)."""
    for rank, r in enumerate(results):
        (losses, state), (ref_losses, ref_state) = r[CLIPPED.name], r[f"{CLIPPED.name}/ref"]
        assert losses == pytest.approx(ref_losses, rel=1e-6), rank
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    unclipped = results[0]["s2"][1]["pos"]
    assert not torch.allclose(results[0][CLIPPED.name][1]["pos"], unclipped, rtol=1e-4), "clipping must bite"


def test_hybrid_sharding_is_ddp_over_every_rank_to_rounding(results: list[dict[str, Any]]) -> None:
    _, ours = results[0]["s3"]
    _, ddp = results[0]["ddp-all-four"]
    for k, v in ddp.items():
        torch.testing.assert_close(ours[k], v, rtol=1e-5, atol=1e-6)


def test_the_first_group_writes_the_checkpoint_and_every_group_loads_it(results: list[dict[str, Any]]) -> None:
    saved = {r["checkpoint"]["saved"] for r in results}
    assert len(saved) == 1, saved
    # the first group's two ranks' files (a shard group's ranks are 0 and 1), written by it alone
    assert all(r["checkpoint"]["files"] == ["manifest.json", "module_state.bin", "rank00000.bin", "rank00001.bin"]
               for r in results), [r["checkpoint"]["files"] for r in results]
    assert all(r["checkpoint"]["equal"] for r in results)
    # each rank resumes its own random stream, the second group's ranks too (stored by global rank)
    assert [r["checkpoint"]["rng"] for r in results] == [True] * WORLD
    # a Hugging Face folder is written by global rank 0 alone, not by each group's first rank
    assert [r["checkpoint"]["leads"] for r in results] == [True, False, False, False]


def test_a_world_the_groups_do_not_divide_and_a_model_over_its_own_group_are_refused(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert len(r["refused"]) == 2, r["refused"]
        assert "does not divide the world of 4 ranks" in r["refused"][0]
        assert "over a process group of its own" in r["refused"][1]


def test_a_group_of_fewer_than_two_ranks_is_refused() -> None:
    import zeroinf

    with pytest.raises(zeroinf.ConfigError, match="shard_group_size"):
        zeroinf.Config(shard_group_size=1)
    with pytest.raises(zeroinf.ConfigError, match="shard_group_size"):
        zeroinf.Config(shard_group_size=0)


def test_built_under_init_every_rank_holds_the_first_ranks_model_and_its_edits(results: list[dict[str, Any]]) -> None:
    """Built under `zeroinf.init` in both groups: after `shard` every rank holds the eager model of that
    seed; a `gathered` write with `modifier_rank=1` lands the first group's rank 1's value everywhere."""
    built = results[0]["init"][0]
    for r in results:
        assert all(torch.equal(built[k], v) for k, v in r["init"][0].items())
        assert bool((r["init"][1] == 1.0).all()), r["init"][1]
    first = _unseeded_state(100)  # global rank 0's seed: zeroinf.init builds the eager model
    assert [k for k, v in first.items() if not torch.equal(built[k], v)] == []



def _unseeded_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return _unseeded().state_dict()


def test_a_unit_one_group_never_reaches_is_reduced_in_every_group(results: list[dict[str, Any]]) -> None:
    """Which parameters a backward reaches is agreed over the world: agreed in the shard group only,
    one group would reduce an expert inside backward and the other never, across the replicas."""
    for rank, r in enumerate(results):
        ref_losses, ref_state = r["routed"]["ref"]
        for stage in ("s3", "s2"):
            losses, state = r["routed"][stage]
            assert losses == ref_losses, (rank, stage, losses, ref_losses)
            assert [k for k, v in ref_state.items() if not torch.equal(state[k], v)] == [], (rank, stage)
    first = results[0]["routed"]["ref"][1]
    assert not torch.equal(first["experts.0.fc.weight"], results[0]["routed"]["ref"][1]["experts.1.fc.weight"])
