"""Which device a rank runs on: ZEROINF_DEVICE pins it, else cuda:LOCAL_RANK where CUDA is present,
else the CPU; a LOCAL_RANK without a GPU fails at start with an error naming ranks and devices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from zeroinf.topology import DEVICE_ENV, check_ranks_fit, default_device


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Pretend the machine has `count` CUDA devices."""

    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    return set_count


def test_pinned_cpu_wins_over_a_gpu(monkeypatch: pytest.MonkeyPatch, gpus: Callable[[int], None]) -> None:
    gpus(1)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device() == torch.device("cpu")


def test_local_rank_picks_its_gpu(monkeypatch: pytest.MonkeyPatch, gpus: Callable[[int], None]) -> None:
    gpus(2)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)
    monkeypatch.setenv(DEVICE_ENV, "cuda")  # "cuda" alone still means this rank's GPU
    assert default_device() == torch.device("cuda", 1)


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, gpus: Callable[[int], None]) -> None:
    gpus(1)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    expected = r"LOCAL_RANK=1 \(of 2 .*1 CUDA device\(s\) \(cuda:0..cuda:0\).*nproc-per-node 1"
    with pytest.raises(RuntimeError, match=expected):
        default_device()


def test_no_cuda_at_all(monkeypatch: pytest.MonkeyPatch, gpus: Callable[[int], None]) -> None:
    gpus(0)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "cuda:0")
    with pytest.raises(RuntimeError, match=r"0 CUDA device\(s\) \(none\).*ZEROINF_DEVICE=cpu"):
        default_device()


def test_launching_more_ranks_than_gpus_fails_before_launch(
    monkeypatch: pytest.MonkeyPatch, gpus: Callable[[int], None]
) -> None:
    gpus(1)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    check_ranks_fit(1)
    with pytest.raises(ValueError, match=r"--nproc 2 needs 2 GPUs .* has 1: use --nproc 1, or set ZEROINF_DEVICE=cpu"):
        check_ranks_fit(2)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    check_ranks_fit(2)  # ranks on the CPU: any number


_NO_INIT_SCRIPT = """
import json, os, torch, zeroinf
from zeroinf.models.gpt import GPT, GPTConfig
torch.manual_seed(0)
model = zeroinf.shard(GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)), zeroinf.Config(stage=2))
opt = zeroinf.AdamW(model, lr=1e-2)
rank = int(os.environ["RANK"])
for step in range(2):  # each rank its own batch: only averaged gradients keep the ranks' weights equal
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
    opt.backward(model(x, x))
    opt.step()
    opt.zero_grad()
engine = zeroinf.engine_of(model)
weights = sum(p.detach().double().sum().item() for p in model.parameters())
print(json.dumps({"world": engine.topo.world_size, "rank": engine.topo.rank, "weights": weights}))
torch.distributed.destroy_process_group()
"""


def test_shard_under_torchrun_initializes_the_process_group() -> None:
    """A script launched by torchrun that calls `zeroinf.shard` without initializing a process group
    trains one world of 2, as under DeepSpeed's `initialize`: before, each rank trained a world of
    its own, silently (its own weights, no averaging)."""
    import json

    from tests._launch import run_ranks_as_processes

    ranks = run_ranks_as_processes(["-c", _NO_INIT_SCRIPT], world=2, timeout_s=120)
    reports = []
    for r in ranks:
        assert r.returncode == 0, r.stderr[-3000:]
        reports.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert [(rep["world"], rep["rank"]) for rep in reports] == [(2, 0), (2, 1)], reports
    assert reports[0]["weights"] == reports[1]["weights"], reports
