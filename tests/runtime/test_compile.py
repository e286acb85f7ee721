"""`torch.compile` on a sharded model trains exactly as the model does without it.

zeroinf's hooks run eagerly (runtime/hooks.py `eager`), so the compiler breaks its graph at each
unit's boundary and compiles the units' own code. With the `aot_eager` backend (the compiler's
tracing and autograd, no kernel fusion) the compiled model must give bitwise the losses and weights
of the same configuration run eagerly, and plain PyTorch's within the parity tolerances
(tests/test_parity.py); `inductor` (fused kernels, other rounding) is held to the tolerances. And
the compiler's guards must hold: after the second step nothing compiles again (an index or a shard's
state in a guard would recompile per unit until torch's recompile limit sends the model back to
eager). The first two steps may compile more than once: the model's own branches (the zoo calls a
block with two temperatures) and the rare hook path that fetches a unit for a module called outside
it compile as they are first met.

One spawned world-2 group runs every case: stages 0-3, parameters and optimizer states on the host
or NVMe, activation checkpointing with and without offloaded activations, and the model zoo (a unit's
module called from another unit's forward goes through the external-fetch path of the hooks).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import Case, run_cases, with_name
from tests.test_parity import TOLERANCES, reference
from zeroinf import OffloadConfig

STEPS = 4
SHARD_ALL = ("persist_threshold_bytes", 0)


def eager_cases(root: Path) -> list[Case]:
    def nvme(name: str) -> OffloadConfig:
        (root / name).mkdir()
        return OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(root / name))

    host = OffloadConfig(params="host", optimizer="host")
    return [
        Case("s0", 0, steps=STEPS),
        Case("s1", 1, steps=STEPS),
        Case("s2-bf16", 2, "bf16", steps=STEPS),
        Case("s3-host", 3, steps=STEPS, overrides=(("offload", host), SHARD_ALL)),
        Case("s3-nvme-bf16", 3, "bf16", steps=STEPS, overrides=(("offload", nvme("s3-nvme-bf16")), SHARD_ALL)),
        Case("s3-host-ckpt", 3, steps=STEPS,
             overrides=(("offload", host), ("activation_checkpointing", True), SHARD_ALL)),
        Case("s3-nvme-ckpt-offload-bf16", 3, "bf16", steps=STEPS, overrides=(
            ("offload", nvme("s3-nvme-ckpt")), ("activation_checkpointing", True), ("offload_activations", True),
            SHARD_ALL,
        )),
        Case("zoo-s3", 3, steps=STEPS, model="zoo", overrides=(SHARD_ALL,)),
    ]


def compiled(case: Case, backend: str, root: Path) -> Case:
    overrides = []
    for key, value in case.overrides:
        if key == "offload" and value.nvme_dir is not None:  # its own swap folder: both run in one process
            folder = Path(value.nvme_dir + f"-{backend}")
            folder.mkdir()
            value = replace(value, nvme_dir=str(folder))
        overrides.append((key, value))
    return replace(with_name(case, f"-{backend}"), overrides=tuple(overrides), compile_backend=backend)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Case], dict[str, dict]]:
    root = tmp_path_factory.mktemp("compile")
    eager = eager_cases(root)
    cases = eager + [compiled(c, "aot_eager", root) for c in eager] + [compiled(eager[3], "inductor", root)]
    per_rank = run_ranks(run_cases, 2, cases, timeout_s=600)
    return eager, per_rank[0]


def test_aot_eager_is_bitwise_the_eager_run(results: tuple[list[Case], dict[str, dict]]) -> None:
    eager, ours = results
    for case in eager:
        plain, traced = ours[case.name], ours[case.name + "-aot_eager"]
        assert traced["losses"] == plain["losses"], f"{case.name}: losses {traced['losses']} vs {plain['losses']}"
        for name, w in plain["weights"].items():
            assert torch.equal(traced["weights"][name], w), f"{case.name}: weight {name} differs compiled"


def test_compiled_runs_match_plain_pytorch(results: tuple[list[Case], dict[str, dict]]) -> None:
    eager, ours = results
    for case in [*eager, eager[3]]:
        for backend in ("aot_eager", "inductor") if case is eager[3] else ("aot_eager",):
            got = ours[f"{case.name}-{backend}"]
            ref_losses, ref_weights, _ = reference(replace(case, overrides=()))
            loss_rtol, weight_atol = TOLERANCES[case.dtype]
            assert got["losses"] == pytest.approx(ref_losses, rel=loss_rtol), f"{case.name} {backend}"
            for name, ref in ref_weights.items():
                torch.testing.assert_close(
                    got["weights"][name], ref, rtol=loss_rtol if case.dtype == "fp32" else 0, atol=weight_atol,
                    msg=lambda m, where=f"{case.name} {backend}: weight {name}": f"{where}: {m}",
                )


def test_units_compile_once(results: tuple[list[Case], dict[str, dict]]) -> None:
    eager, ours = results
    for name, got in ours.items():
        frames = got["frames_compiled"]
        if not frames:
            continue
        assert frames[0] >= 1, f"{name}: torch.compile compiled nothing"
        assert frames[1:] == [frames[1]] * (len(frames) - 1), f"{name}: frames compiled by each step {frames}"


def test_module_compile_in_place_matches_eager() -> None:
    """`model.compile()` (nn.Module.compile: the module itself, its hooks included, goes through the
    compiler) on a sharded model, in this process: bitwise the eager run."""
    import zeroinf
    from tests._parity import build_model, train_step

    def train(compile_it: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=OffloadConfig(params="host"))
        model = zeroinf.shard(build_model(), cfg)
        opt = zeroinf.AdamW(model, lr=1e-2)
        if compile_it:
            torch._dynamo.reset()
            model.compile(backend="aot_eager")
        losses = [train_step(model, opt, step) for step in range(3)]
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        zeroinf.engine_of(model).close()
        return losses, weights

    (eager_losses, eager_weights), (losses, weights) = train(False), train(True)
    assert losses == eager_losses
    assert all(torch.equal(weights[k], w) for k, w in eager_weights.items())
