"""Elastic checkpoints across processes: exact resume at the same world size (stage 2, and stage 3
with parameters and optimizer states on NVMe), resharding to world 1, 3 and 4 (world 3: shards that
do not divide evenly; world 1 also into another stage and offload placement), and streaming
consolidation of a model 4x larger than its memory allowance.

One spawned group per phase: world 2 trains straight and saves at step 5 (stage 3 on NVMe also in
the background, while the next step trains); new world-2 processes load and continue; worlds 1, 3
and 4 load the same checkpoints and continue. Global batches of 12 samples split over every world.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import LR, build_model, train_rank_slices

STEPS, SAVE_AT = 10, 5
BATCH = 12  # samples per global batch: splits over worlds 1-4
# name -> (stage, states on nvme)
CONFIGS = {"s2": (2, False), "s3nvme": (3, True)}
BIG_LAYERS, BIG_DIM = 4, 2896  # 33.5M fp32 parameters: 134 MB of weights


def _make(stage: int, nvme: bool, scratch: str, model: torch.nn.Module | None = None):
    import zeroinf

    kw: dict = {}
    if nvme:
        folder = tempfile.mkdtemp(dir=scratch)
        kw = dict(offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder),
                  persist_threshold_bytes=0)
    m = zeroinf.shard(model if model is not None else build_model(), zeroinf.Config(stage=stage, **kw))
    return m, zeroinf.AdamW(m, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def phase_save(rank: int, world: int, root: str, scratch: str) -> dict:
    import zeroinf.checkpoint as ck

    out = {}
    for name, (stage, nvme) in CONFIGS.items():
        m, o = _make(stage, nvme, scratch)
        out[name] = train_rank_slices(m, o, rank, world, 0, STEPS, BATCH)
        m, o = _make(stage, nvme, scratch)
        train_rank_slices(m, o, rank, world, 0, SAVE_AT, BATCH)
        ck.save(os.path.join(root, name), m, o, step=SAVE_AT, extra={"data_position": SAVE_AT})
        if name == "s3nvme":  # the same checkpoint again, written in the background while training goes on
            pending = ck.save(os.path.join(root, "s3nvme-bg"), m, o, step=SAVE_AT,
                              extra={"data_position": SAVE_AT}, blocking=False)
            assert isinstance(pending, ck.PendingSave) and o.pending_save is pending
            # its step() finishes the checkpoint
            after = train_rank_slices(m, o, rank, world, SAVE_AT, SAVE_AT + 1, BATCH)
            assert o.pending_save is None and pending.wait() == os.path.join(root, "s3nvme-bg", "step_00000005")
            assert after == out[name][SAVE_AT : SAVE_AT + 1]  # saving changed nothing in training
    # A bigger stage-3 model for consolidation; rank 0 keeps the gathered weights as the oracle.
    torch.manual_seed(0)
    big = torch.nn.Sequential(*[torch.nn.Linear(BIG_DIM, BIG_DIM, bias=False) for _ in range(BIG_LAYERS)])
    m, o = _make(3, False, scratch, big)
    x = torch.randn(2, BIG_DIM)
    o.backward(m(x).square().mean())
    o.step()
    o.zero_grad()
    ck.save(os.path.join(root, "big"), m, o, step=1)
    full = m.state_dict()  # a collective at stage 3
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.float().contiguous() for k, v in full.items()}, os.path.join(root, "big_oracle.safetensors"))
    return out


def phase_load(rank: int, world: int, root: str, scratch: str, plan: list[tuple[str, str]]) -> dict:
    """plan: (checkpoint name, config to load it into)."""
    import zeroinf.checkpoint as ck

    out = {}
    for ckpt, cfg in plan:
        stage, nvme = CONFIGS[cfg]
        m, o = _make(stage, nvme, scratch)
        info = ck.load(os.path.join(root, ckpt), m, o)
        assert info["step"] == SAVE_AT and info["extra"] == {"data_position": SAVE_AT}, info
        out[f"{ckpt}->{cfg}"] = train_rank_slices(m, o, rank, world, info["step"], STEPS, BATCH)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, dict]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    scratch = str(tmp_path_factory.mktemp("swap"))
    straight = run_ranks(phase_save, 2, root, scratch, timeout_s=240)[0]
    return root, scratch, straight


def test_resume_same_world_is_exact(saved: tuple[str, str, dict]) -> None:
    root, scratch, straight = saved
    plan = [("s2", "s2"), ("s3nvme", "s3nvme"), ("s3nvme-bg", "s3nvme")]
    resumed = run_ranks(phase_load, 2, root, scratch, plan, timeout_s=240)[0]
    for name in CONFIGS:
        assert resumed[f"{name}->{name}"] == straight[name][SAVE_AT:], name  # fp32: bitwise
    assert resumed["s3nvme-bg->s3nvme"] == straight["s3nvme"][SAVE_AT:]


def test_background_save_writes_the_same_bytes(saved: tuple[str, str, dict]) -> None:
    """`save(blocking=False)` while the next step trains gives the blocking save's checkpoint exactly."""
    import zeroinf.checkpoint as ck

    root = saved[0]
    blocking, background = (ck.read_manifest(ck.resolve(os.path.join(root, n))) for n in ("s3nvme", "s3nvme-bg"))
    for key in ("chunks", "module_state", "rng", "params", "optimizer", "files"):
        assert blocking[key] == background[key], key  # every chunk's checksum included
    ck.verify(os.path.join(root, "s3nvme-bg"))


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_matches_straight_run(saved: tuple[str, str, dict], world: int) -> None:
    root, scratch, straight = saved
    # worlds 1 and 3: also into another stage and offload placement (NVMe states -> in-memory stage 2
    # and back)
    plan = {1: [("s2", "s2"), ("s3nvme", "s2")], 3: [("s2", "s3nvme"), ("s3nvme", "s3nvme")]}.get(
        world, [("s2", "s2"), ("s3nvme", "s3nvme")]
    )
    resumed = run_ranks(phase_load, world, root, scratch, plan, timeout_s=240)[0]
    for key, losses in resumed.items():
        ref = straight[key.split("->")[0]][SAVE_AT:]
        assert losses == pytest.approx(ref, rel=1e-5), f"world {world} {key}: {losses} vs {ref}"


_CONSOLIDATE = """
import json, sys, resource
import zeroinf.checkpoint as ck
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset VmHWM to the current RSS
# Warm up on a small checkpoint first: the first use of torch's kernels pages in tens of MiB of
# library code, which is not memory the model's size causes.
ck.consolidate(sys.argv[3], sys.argv[2] + '-warmup', dtype='fp32')
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS:')
ck.consolidate(sys.argv[1], sys.argv[2], dtype='fp32', max_shard_bytes=50_000_000)
print(json.dumps({'rss_before': before, 'hwm': status('VmHWM:')}))
"""


def test_consolidate_streams_a_model_larger_than_memory(saved: tuple[str, str, dict], tmp_path) -> None:
    from safetensors.torch import load_file

    root, _, _ = saved
    out = tmp_path / "hf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CONSOLIDATE, os.path.join(root, "big"), str(out),
                           os.path.join(root, "s2")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    mem = json.loads(proc.stdout.strip().splitlines()[-1])
    model_bytes = BIG_LAYERS * BIG_DIM * BIG_DIM * 4
    peak = mem["hwm"] - mem["rss_before"]
    print(f"consolidate: model {model_bytes / 2**20:.0f} MiB, peak RSS growth {peak / 2**20:.1f} MiB")
    assert peak < model_bytes / 4, (peak, model_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == BIG_LAYERS  # 50 MB shards: one layer each
    oracle = load_file(os.path.join(root, "big_oracle.safetensors"))
    got = {}
    for fname in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / fname)))
    assert got.keys() == oracle.keys()
    for k in oracle:
        assert torch.equal(got[k], oracle[k]), k
