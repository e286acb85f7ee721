"""A process that never closes the engine or the optimizer still exits with status 0 and no abort.

Each launch is a 2-rank stage-3 run of tests/_rank_script.py (real processes, real interpreter
exit) that trains two steps, calls `destroy_process_group()` and returns without any close call,
for each placement: everything in memory, optimizer on host, params + optimizer on NVMe, and
params + optimizer + gradients on NVMe. Checked per rank: exit status 0, nothing on stderr that
says abort, traceback or leak, no gloo thread left once the process group is destroyed (see
[Note: a process group that outlives destroy_process_group] in topology.py), and the swap files
removed by the finalizers at exit. The default run launches each placement once; the slow variant
ten times.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests._launch import Finished, run_ranks_as_processes

SCRIPT = str(Path(__file__).with_name("_rank_script.py"))
PLACEMENTS = ("memory", "host", "nvme", "all-nvme")
BAD_SIGNS = ("terminate called", "Traceback", "Fatal Python error", "core dumped", "leaked semaphore", "Aborted")
CONCURRENT_LAUNCHES = 2


def launch_all(root: Path, launches: int) -> dict[str, list[tuple[Path, list[Finished]]]]:
    jobs = [(p, i) for i in range(launches) for p in PLACEMENTS]

    def one(job: tuple[str, int]) -> tuple[Path, list[Finished]]:
        placement, i = job
        swap = root / f"{placement}-{i}" / "swap"  # missing: the run creates it
        swap.parent.mkdir()
        return swap, run_ranks_as_processes([SCRIPT, placement, str(swap)], world=2, timeout_s=240)

    with ThreadPoolExecutor(CONCURRENT_LAUNCHES) as pool:
        results = list(pool.map(one, jobs))
    out: dict[str, list[tuple[Path, list[Finished]]]] = {p: [] for p in PLACEMENTS}
    for (placement, _), result in zip(jobs, results, strict=True):
        out[placement].append(result)
    return out


def check_clean(placement: str, swap: Path, ranks: list[Finished]) -> None:
    reports = []
    for r in ranks:
        what = f"{placement}, rank {r.rank} (exit status {r.returncode}):\n{r.stderr[-4000:]}"
        assert r.returncode == 0, what
        assert not [s for s in BAD_SIGNS if s in r.stderr], what
        reports.append(json.loads(r.stdout.strip().splitlines()[-1]))
        assert reports[-1]["gloo_threads_after_destroy"] == 0, what
    assert reports[0]["losses"] == reports[1]["losses"], placement
    if swap.exists():  # placements with NVMe: the folder was created, and the files are gone at exit
        assert not list(swap.iterdir()), f"{placement}: swap files left behind: {list(swap.iterdir())}"
    else:
        assert placement in ("memory", "host")


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[Path, list[Finished]]]]:
    return launch_all(tmp_path_factory.mktemp("clean-exit"), launches=1)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_exits_cleanly_without_close(launches: dict, placement: str) -> None:
    for swap, ranks in launches[placement]:
        check_clean(placement, swap, ranks)


@pytest.mark.slow
def test_exits_cleanly_without_close_ten_launches(tmp_path: Path) -> None:
    results = launch_all(tmp_path, launches=10)
    failures = []
    for placement, runs in results.items():
        for swap, ranks in runs:
            try:
                check_clean(placement, swap, ranks)
            except AssertionError as e:
                failures.append(str(e)[:2000])
    launches = sum(len(r) for r in results.values())
    print(f"clean exit: {len(failures)} failed launches of {launches} ({launches // len(PLACEMENTS)} per placement)")
    assert not failures, "\n\n".join(failures)
