"""Where the states live changes nothing: at stage 3, the same training on the device, on the host
and on NVMe (and split between them) gives bitwise the same losses, weights, gradient norms and
skipped steps, in fp32, bf16 and fp16.

The parity tests compare each placement with plain PyTorch within a tolerance (the order of sums
differs there); between placements of zeroinf itself nothing should differ at all: the same
reductions in the same order, the same fused AdamW kernel, the same casts, only the memory the
bytes sit in and when they move. A tolerance would hide a placement that, say, steps a stale shard
once (a 1e-7 change) or rounds a bf16 moment twice. World 3 (shards that do not divide evenly), one
group of 3 ranks for every case. A random search over these knobs (210 pairs: worlds 1-4, three
dtypes, clipping, accumulation, an fp16 overflow, checkpointing, bf16 moments, the step inside
backward on or off) found no difference; these cases keep the combinations that exercise most. So
did 180 pairs that changed only scheduling knobs (prefetch and live-byte budgets, split_root,
reuse_step_memory, the persistence threshold, bucket size, the step thread, a parameter cache,
staging buffer counts, the aio engine's block size, queue depth, workers and O_DIRECT).

The one knob that is not bitwise: an `offload.sub_group_numel` whose cuts fall inside a parameter
off a multiple of 16 elements from where that parameter's piece starts (any value below 1024, where
cuts are not rounded). PyTorch's fused CPU AdamW runs a vector loop over 64-byte task units and a
scalar tail over the last numel % 16 elements of each tensor it gets, and the two round differently:
elements that move between them differ by an ulp (5.96e-8 after 5 steps). tests/optim/test_states.py
keeps its cuts on that grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import Case, run_cases
from zeroinf import OffloadConfig

WORLD, BATCH = 3, 12
STEPS = 6  # of the demo run below
# (params, optimizer, gradients) tiers; the first is the baseline of its group
PLACEMENTS = {
    "device": ("device", "device", "device"),
    "host": ("host", "host", "host"),
    "nvme": ("nvme", "nvme", "device"),
    "pnvme-ohost": ("nvme", "host", "host"),
}
# group -> (dtype, micro-steps, clip, fp16 overflow step, moment dtype, extra Config fields)
GROUPS: dict[str, tuple[str, int, float | None, int | None, str, tuple[tuple[str, Any], ...]]] = {
    "fp32-clip-ckpt": ("fp32", 1, 0.05, None, "fp32", (("activation_checkpointing", True),)),
    "bf16-accum2-bf16moments": ("bf16", 2, None, None, "bf16", (("persist_threshold_bytes", 0),)),
    "fp16-overflow-clip": ("fp16", 1, 1.0, 2, "fp32", (("persist_threshold_bytes", 0),)),
}


def cases(nvme_root: str) -> list[Case]:
    out = []
    for group, (dtype, accum, clip, overflow, moments, extra) in GROUPS.items():
        for name, (params, optimizer, gradients) in PLACEMENTS.items():
            folder = None
            if "nvme" in (params, optimizer):
                folder = str(Path(nvme_root) / f"{group}-{name}")
                Path(folder).mkdir(parents=True)
            offload = OffloadConfig(
                params=params, optimizer=optimizer, gradients=gradients, moment_dtype=moments, nvme_dir=folder
            )
            out.append(Case(
                f"{group}/{name}", 3, dtype, accum=accum, clip=clip, overflow_step=overflow,
                overrides=extra + (("offload", offload),), batch=BATCH, steps=5,
            ))
    return out


def _bits(losses: list[float]) -> torch.Tensor:
    """The losses' bit patterns: NaN (the fp16 overflow's loss) equals itself there."""
    return torch.tensor(losses, dtype=torch.float64).view(torch.int64)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_ranks(run_cases, WORLD, cases(str(tmp_path_factory.mktemp("nvme"))), timeout_s=300)[0]


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("placement", [p for p in PLACEMENTS if p != "device"])
def test_a_placement_trains_bitwise_as_on_the_device(
    results: dict[str, dict[str, Any]], group: str, placement: str
) -> None:
    base, other = results[f"{group}/device"], results[f"{group}/{placement}"]
    assert torch.equal(_bits(other["losses"]), _bits(base["losses"])), (base["losses"], other["losses"])
    assert other["skipped"] == base["skipped"]
    assert other["grad_norms"] == base["grad_norms"]
    if GROUPS[group][3] is not None:  # the overflow skipped exactly that step
        assert base["skipped"] == [step == GROUPS[group][3] for step in range(5)]
    for name, weight in base["weights"].items():
        assert torch.equal(other["weights"][name], weight), f"{group}/{placement}: {name} differs"



def _norms_and_masters(tmp_path: Path, gradients: str, step_in_backward: bool | str) -> tuple[list[float], bytes]:
    """The demo run (`zeroinf train --model tiny`: its corpus, schedule and parameter groups) in bf16
    with clipping, parameters and states on NVMe: STEPS steps' gradient norms, and the checkpoint
    manifest's checksums of every master and moment after them."""
    import zeroinf
    import zeroinf.checkpoint as ck
    from zeroinf import train

    folder = tmp_path / f"{gradients}-{step_in_backward}"
    folder.mkdir()
    cfg = zeroinf.Config(
        stage=3, param_dtype="bf16", grad_clip_norm=1.0, persist_threshold_bytes=0,
        offload=OffloadConfig(params="nvme", optimizer="nvme", gradients=gradients,
                              step_in_backward=step_in_backward, nvme_dir=str(folder / "swap")),
    )
    run = train.build_run(train.TrainArgs(
        model="tiny", steps=1000, config=cfg, eval_batches=0, progress=False
    ))
    norms = []
    for step in range(STEPS):
        train.train_step(run, step)
        norms.append(run.opt.last_grad_norm)  # type: ignore[attr-defined]
    ck.save(str(folder / "ckpt"), run.model, run.opt, step=STEPS)
    chunks = ck.read_manifest(ck.resolve(str(folder / "ckpt")))["chunks"]
    run.opt.close()  # type: ignore[attr-defined]
    zeroinf.engine_of(run.model).close()
    return norms, repr(sorted(chunks.items())).encode()


def test_gradient_shards_on_nvme_clip_by_the_same_norm(tmp_path: Path) -> None:
    """Gradients on NVMe, in memory, and the step inside backward (speculative with clipping: after
    its first step is undone, the next steps keep their gradients in memory) clip by the same norm, to
    the bit, and end with the same masters and moments (optim/clip.py [Note: one norm wherever the
    gradients are]). Before, NVMe shards' squares were summed in double: here the norms parted in the
    last bit at the third step, and the runs for good."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the run where the old sums parted (whether they do depends on the bits)
    try:
        norms, states = _norms_and_masters(tmp_path, "nvme", False)
        assert max(norms) > 1.0  # clipping happens
        for gradients, step_in_backward in (("nvme", "auto"), ("device", False)):
            other_norms, other_states = _norms_and_masters(tmp_path, gradients, step_in_backward)
            assert other_norms == norms, (gradients, step_in_backward)
            assert other_states == states, (gradients, step_in_backward)
    finally:
        torch.set_num_threads(threads)
