"""The CUDA path: `pytest -m gpu` on a machine with a GPU (skipped without one; the default run
excludes the marker). Everything here runs on cuda:0 in one process.

- Parity with plain PyTorch on the same GPU: stages 0-3 x the placements of parameters, gradients
  and optimizer states (device, host, nvme) x fp32/bf16, with the tolerances of tests/test_parity.py.
- The transfer path: in a steady step with states on the host, every copy between host and device
  goes through the owner (runtime/streams.py) from pinned memory, and its pool allocates nothing.
- The demo CLI trains on the GPU.
- Parameters on the host: after a forward the GPU holds what the ledger counts, a unit at most beyond.
- `model.load_state_dict` sets the fp32 masters exactly there, and a conversion after `shard` is refused.
- `torch.compile` (inductor, Triton kernels) on a sharded model: the tolerances of the parity
  matrix against plain PyTorch, with parameters and optimizer states on the GPU or the host.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._launch import SRC
from tests._parity import Case, train_reference, train_zeroinf
from tests.test_parity import TOLERANCES
from zeroinf import OffloadConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
STEPS = 5
PLACEMENTS: dict[str, tuple[int, dict[str, str]]] = {  # name: (stage, tiers off the device)
    "s0-device": (0, {}),
    "s1-device": (1, {}),
    "s2-device": (2, {}),
    "s3-device": (3, {}),
    "s1-ohost": (1, {"optimizer": "host"}),
    "s2-ghost-ohost": (2, {"gradients": "host", "optimizer": "host"}),
    "s2-gnvme-onvme": (2, {"gradients": "nvme", "optimizer": "nvme"}),
    "s3-ohost": (3, {"optimizer": "host"}),
    "s3-phost-ghost-ohost": (3, {"params": "host", "gradients": "host", "optimizer": "host"}),
    "s3-phost-odevice": (3, {"params": "host"}),
    "s3-pnvme-gnvme-onvme": (3, {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}),
}
HOST_PLACEMENTS = ["s1-ohost", "s2-ghost-ohost", "s3-ohost", "s3-phost-ghost-ohost"]


@pytest.fixture(autouse=True)
def exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def case_for(name: str, dtype: str, nvme_dir: Path, accum: int = 1, steps: int = STEPS) -> Case:
    stage, tiers = PLACEMENTS[name]
    offload = OffloadConfig(**tiers, nvme_dir=str(nvme_dir), sub_group_numel=5000)
    extra = (("persist_threshold_bytes", 0),) if stage == 3 else ()
    return Case(f"{name}-{dtype}", stage, dtype, accum=accum, steps=steps, overrides=(("offload", offload),) + extra)


@functools.cache
def reference(dtype: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(Case(f"reference-{dtype}", 0, dtype, steps=STEPS), CUDA)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_matches_plain_pytorch_on_the_gpu(name: str, dtype: str, tmp_path: Path) -> None:
    ours = train_zeroinf(case_for(name, dtype, tmp_path), 0, 1, CUDA)
    ref_losses, ref_weights = reference(dtype)
    loss_rtol, weight_atol = TOLERANCES[dtype]
    for step, (a, b) in enumerate(zip(ours["losses"], ref_losses, strict=True)):
        assert math.isfinite(a) and a == pytest.approx(b, rel=loss_rtol), f"{name} {dtype}: step {step}: {a} vs {b}"
    for pname, ref in ref_weights.items():
        torch.testing.assert_close(
            ours["weights"][pname], ref, rtol=loss_rtol if dtype == "fp32" else 0, atol=weight_atol,
            msg=lambda m, pname=pname: f"{name} {dtype}: {pname}: {m}",
        )


@pytest.mark.parametrize("name", HOST_PLACEMENTS)
def test_a_steady_step_copies_through_the_owner_from_pinned_memory(name: str, tmp_path: Path) -> None:
    """Step 3 of 3 (two micro-steps each): gradients went down and parameters up through the owner,
    none from pageable memory (a hidden synchronization), and its pool allocated nothing."""
    out = train_zeroinf(case_for(name, "bf16", tmp_path, accum=2, steps=3), 0, 1, CUDA)
    last = out["transfers"]["last_step"]
    assert last["d2h_copies"] > 0 and last["h2d_copies"] > 0, last
    assert last["pageable_copies"] == 0, last
    assert last["staging_allocations"] == 0, last


def test_demo_cli_trains_on_the_gpu(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = [
        "train", "--model", "tiny", "--steps", "5", "--batch", "4", "--seq-len", "32", "--eval-batches", "1",
        "--dtype", "bf16", "--stage", "3", "--offload-optimizer", "host", "--offload-gradients", "host",
        "--no-progress", "--report", str(report),
    ]
    env = {**os.environ, "ZEROINF_DEVICE": "cuda", "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "zeroinf", *argv], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(report.read_text())
    assert len(summary["losses"]) == 5 and all(math.isfinite(x) for x in summary["losses"])


@pytest.mark.parametrize("params", ["device", "host"])
def test_load_state_dict_on_the_gpu_sets_the_fp32_masters_exactly(params: str) -> None:
    """`model.load_state_dict` on CUDA (partition/load_state.py): fp32 weights into a bf16 stage-3
    model whose shards are on the GPU or the host, optimizer on the host."""
    import zeroinf
    from tests._parity import build_model, global_batch
    from tests.partition.test_load_state import check_bf16_masters_take_the_loaded_fp32_values

    cfg = zeroinf.Config(
        stage=3, param_dtype="bf16", persist_threshold_bytes=0, offload=OffloadConfig(params=params, optimizer="host")
    )
    model = zeroinf.shard(build_model(seed=1), cfg, zeroinf.Topology.single(CUDA))
    opt = zeroinf.AdamW(model, lr=1e-3)
    x, y = (t.to(CUDA) for t in global_batch(0))
    opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()
    check_bf16_masters_take_the_loaded_fp32_values(model, opt)
    opt.backward(model(x, y))  # and training goes on from them
    opt.step()
    model.to("cpu")  # a conversion after shard: the next forward refuses it
    with pytest.raises(RuntimeError, match="the model was converted after zeroinf.shard"):
        model(x.cpu(), y.cpu())


@pytest.mark.parametrize("name", ["s3-device", "s3-phost-ghost-ohost"])
def test_torch_compile_matches_plain_pytorch_on_the_gpu(name: str, tmp_path: Path) -> None:
    """tests/runtime/test_compile.py on CUDA: the units compile to Triton kernels, the hooks move
    shards between the graphs, and nothing compiles after the second step."""
    from dataclasses import replace

    case = replace(case_for(name, "bf16", tmp_path), compile_backend="inductor")
    ours = train_zeroinf(case, 0, 1, CUDA)
    ref_losses, ref_weights = reference("bf16")
    loss_rtol, weight_atol = TOLERANCES["bf16"]
    assert ours["losses"] == pytest.approx(ref_losses, rel=loss_rtol), name
    for pname, ref in ref_weights.items():
        torch.testing.assert_close(ours["weights"][pname], ref, rtol=0, atol=weight_atol, msg=lambda m: f"{name}: {m}")
    frames = ours["frames_compiled"]
    assert frames[0] >= 1 and frames[1:] == [frames[1]] * (len(frames) - 1), frames


def test_host_homed_shards_leave_no_device_copy_behind() -> None:
    """Parameters on the host: after a forward, the GPU holds what the ledger counts, plus at most one
    unit. Each unit's device copy of its shard used to stay referenced until its next gather or step
    (partition/shard_home.py `MemoryHome.end_load`): 8 units' copies held at the end of forward, while
    the ledger counted them released (tests/partition/test_shard_home.py checks the CPU side)."""
    import zeroinf

    model = zeroinf.shard(
        torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)]),
        zeroinf.Config(
            stage=3, param_dtype="bf16", persist_threshold_bytes=0,
            offload=OffloadConfig(params="host", optimizer="host"),
        ),
        zeroinf.Topology.single(CUDA),
    )
    engine = zeroinf.engine_of(model)
    assert len(engine.units) == 8
    unit_bytes = max(u.unsharded_bytes for u in engine.units)  # 2 MiB each

    def settled() -> tuple[int, int]:
        torch.cuda.synchronize(CUDA)
        torch.empty(1, device=CUDA)  # the allocator processes frees waiting on stream events
        return torch.cuda.memory_allocated(CUDA), int(engine.ledger.snapshot()["device"]["live_bytes"])

    x = torch.randn(4, 1024, device=CUDA, dtype=torch.bfloat16)
    try:
        (x @ x.T).sum().item()  # cuBLAS's workspace for this stream comes from the allocator: before, not during
        gpu_before, ledger_before = settled()
        with torch.no_grad():
            model(x)
        gpu_after, ledger_after = settled()
        extra = (gpu_after - gpu_before) - (ledger_after - ledger_before)
        assert extra <= unit_bytes, f"{extra / 2**20:.1f} MiB on the GPU beyond the ledger after a forward"
    finally:
        engine.close()
