"""Node-local checkpoints (checkpoint/saving.py [Note: node-local checkpoints]): two ranks, each on
a "machine" of its own (torchrun's GROUP_RANK) with its own disk (a folder no other rank sees).

`zeroinf.save(..., node_local=True)` leaves on each disk that machine's own states, the buffers, a
manifest and `latest` (stage 0: a copy of rank 0's file on each); new processes with the same ranks
on each machine load from their own disks and continue the straight run bitwise (stage 0, 2, and 3
on NVMe); `keep_last` prunes each disk. One machine's folder alone is refused at world 1, naming
the file and the machine that holds it (`verify` checks its own files and lists the others',
`consolidate` says to merge); every machine's folders merged load at world 1 and continue the
straight run (within fp32 reduction order). World 3 over two machines (2 + 1 ranks): the machine
with two ranks holds both their states in its one folder, and all three resume bitwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests._harness import run_ranks
from tests._parity import LR, build_model, train_rank_slices

STEPS, SAVE_AT = 6, 3
BATCH = 12
CONFIGS = {"s0": (0, False), "s2": (2, False), "s3nvme": (3, True)}  # name -> (stage, states on NVMe)


def _make(stage: int, nvme: bool, scratch: str):
    import zeroinf

    kw: dict = {}
    if nvme:
        folder = tempfile.mkdtemp(dir=scratch)
        kw = dict(offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=folder),
                  persist_threshold_bytes=0)
    m = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, **kw))
    return m, zeroinf.AdamW(m, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _disk(root: str, rank: int) -> str:
    return os.path.join(root, f"machine{rank}")


def phase_save(rank: int, world: int, root: str, scratch: str) -> dict:
    import zeroinf

    os.environ["GROUP_RANK"] = str(rank)  # a machine of its own
    out: dict = {}
    for name, (stage, nvme) in CONFIGS.items():
        m, o = _make(stage, nvme, scratch)
        out[name] = train_rank_slices(m, o, rank, world, 0, STEPS, BATCH)
        m, o = _make(stage, nvme, scratch)
        folder = os.path.join(_disk(root, rank), name)
        for step in range(1, SAVE_AT + 1):  # a checkpoint after every step, two kept
            train_rank_slices(m, o, rank, world, step - 1, step, BATCH)
            zeroinf.save(folder, m, o, step=step, keep_last=2, node_local=True)
        out[f"{name}:files"] = sorted(os.listdir(os.path.join(folder, "step_00000003")))
        out[f"{name}:steps"] = sorted(f for f in os.listdir(folder) if f.startswith("step_"))
    return out


def phase_load(rank: int, world: int, root: str, scratch: str) -> dict:
    import zeroinf

    os.environ["GROUP_RANK"] = str(rank)
    out = {}
    for name, (stage, nvme) in CONFIGS.items():
        m, o = _make(stage, nvme, scratch)
        info = zeroinf.load(os.path.join(_disk(root, rank), name), m, o)
        out[name] = train_rank_slices(m, o, rank, world, info["step"], STEPS, BATCH)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, list[dict]]:
    root = str(tmp_path_factory.mktemp("machines"))
    scratch = str(tmp_path_factory.mktemp("swap"))
    return root, scratch, run_ranks(phase_save, 2, root, scratch, timeout_s=240)


def test_each_machine_holds_its_own_states_and_resumes_bitwise(saved: tuple[str, str, list[dict]]) -> None:
    root, scratch, per_rank = saved
    for rank, out in enumerate(per_rank):
        for name in CONFIGS:
            own = "rank00000.bin" if name == "s0" else f"rank{rank:05d}.bin"
            assert out[f"{name}:files"] == sorted(["manifest.json", "module_state.bin", own]), (rank, name, out)
            assert out[f"{name}:steps"] == ["step_00000002", "step_00000003"], (rank, name)  # keep_last on each disk
    resumed = run_ranks(phase_load, 2, root, scratch, timeout_s=240)
    for rank in range(2):
        for name in CONFIGS:
            assert resumed[rank][name] == per_rank[rank][name][SAVE_AT:], (rank, name)  # fp32: bitwise


def test_one_machines_folder_is_refused_elsewhere_and_merged_folders_load_anywhere(
    saved: tuple[str, str, list[dict]], tmp_path
) -> None:
    import zeroinf
    from zeroinf.checkpoint.format import CheckpointError

    root, scratch, per_rank = saved
    m, o = _make(2, False, scratch)
    alone = os.path.join(_disk(root, 0), "s2")
    with pytest.raises(CheckpointError, match=r"rank00001.bin: missing.*node-local.*rank 1's, written on GROUP_RANK=1"):
        zeroinf.load(alone, m, o)
    # verify checks what is here and lists what is elsewhere; consolidate needs every rank's states
    summary = zeroinf.checkpoint.verify(alone)
    assert summary["elsewhere"] == ["rank00001.bin"] and summary["files"] == 2, summary
    with pytest.raises(CheckpointError, match="keeps rank00001.bin on other machines: copy every machine's"):
        zeroinf.consolidate(alone, str(tmp_path / "hf"))
    merged = tmp_path / "merged" / "step_00000003"
    for rank in range(2):
        shutil.copytree(os.path.join(_disk(root, rank), "s2", "step_00000003"), merged, dirs_exist_ok=True)
    assert zeroinf.checkpoint.verify(str(merged))["elsewhere"] == []
    info = zeroinf.load(str(merged), m, o)
    losses = train_rank_slices(m, o, 0, 1, info["step"], STEPS, BATCH)
    assert losses == pytest.approx(per_rank[0]["s2"][SAVE_AT:], rel=1e-5)


def test_train_save_node_local_writes_node_local_checkpoints(tmp_path) -> None:
    """`zeroinf train --save-node-local`: its checkpoints are node-local (the manifest names each
    rank's machine) and resume as any other."""
    from zeroinf import cli
    from zeroinf.checkpoint.format import read_manifest, resolve
    from zeroinf.train import TrainArgs, train

    ns = cli.build_parser().parse_args(["train", "--save-node-local", "--save-every", "2", "--save-dir", "d"])
    assert ns.save_node_local
    tiny = dict(model="tiny", seq_len=32, global_batch=8, eval_batches=0, max_corpus_bytes=2**20, progress=False)
    straight = train(TrainArgs(**tiny, steps=4, save_every=2, save_dir=str(tmp_path), save_node_local=True))
    body = read_manifest(resolve(str(tmp_path)))
    assert body["step"] == 4 and len(body["node_local"]) == 1
    resumed = train(TrainArgs(**tiny, steps=4, resume=str(tmp_path / "step_00000002")))
    assert resumed.losses == straight.losses[2:]


def phase_two_on_one(rank: int, world: int, root: str, scratch: str, load: bool) -> dict:
    """Three ranks, two on machine 0 (one disk, one folder), one on machine 1: the machine's first
    rank writes the folder and manifest, the other writes its states beside them."""
    import zeroinf

    machine = 0 if rank < 2 else 1
    os.environ["GROUP_RANK"] = str(machine)
    folder = os.path.join(root, f"machine{machine}", "s3")
    m, o = _make(3, True, scratch)
    if load:
        info = zeroinf.load(folder, m, o)
        return {"after": train_rank_slices(m, o, rank, world, info["step"], STEPS, BATCH)}
    straight = train_rank_slices(m, o, rank, world, 0, STEPS, BATCH)
    m, o = _make(3, True, scratch)
    train_rank_slices(m, o, rank, world, 0, SAVE_AT, BATCH)
    zeroinf.save(folder, m, o, step=SAVE_AT, node_local=True)
    return {"straight": straight, "files": sorted(os.listdir(os.path.join(folder, "step_00000003")))}


def test_two_ranks_on_one_machine_and_one_on_another(tmp_path) -> None:
    """World 3 over two machines (2 + 1 ranks): machine 0's folder holds ranks 0 and 1's states,
    machine 1's rank 2's, each with the manifest; all three resume bitwise from their machines."""
    root, scratch = str(tmp_path / "disks"), str(tmp_path / "swap")
    os.makedirs(scratch)
    saved = run_ranks(phase_two_on_one, 3, root, scratch, False, timeout_s=240)
    assert saved[0]["files"] == ["manifest.json", "module_state.bin", "rank00000.bin", "rank00001.bin"], saved[0]
    assert saved[2]["files"] == ["manifest.json", "module_state.bin", "rank00002.bin"], saved[2]
    loaded = run_ranks(phase_two_on_one, 3, root, scratch, True, timeout_s=240)
    for rank in range(3):
        assert loaded[rank]["after"] == saved[rank]["straight"][SAVE_AT:], rank


def phase_shared(rank: int, world: int, root: str, scratch: str) -> str:
    """Two machines (GROUP_RANK 0 and 1) saving node-local into one folder they both see."""
    import zeroinf
    from zeroinf.checkpoint.format import CheckpointError

    os.environ["GROUP_RANK"] = str(rank)
    m, o = _make(2, False, scratch)
    train_rank_slices(m, o, rank, world, 0, 1, BATCH)
    zeroinf.save(os.path.join(root, "shared"), m, o, step=1)  # an ordinary checkpoint first
    try:
        zeroinf.save(os.path.join(root, "shared"), m, o, step=2, node_local=True)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_node_local_into_a_folder_the_machines_share_is_refused(tmp_path) -> None:
    """On a shared file system, node_local=True would have each machine's first rank write its own
    manifest over the other's: refused on every rank, naming the fix; the checkpoint before stays
    the latest."""
    import zeroinf

    scratch = str(tmp_path / "swap")
    os.makedirs(scratch)
    got = run_ranks(phase_shared, 2, str(tmp_path), scratch, timeout_s=240)
    for message in got:
        assert "is one folder for several machines" in message and "node_local=False" in message, message
    assert zeroinf.checkpoint.verify(str(tmp_path / "shared"))["step"] == 1
