"""`zeroinf.init()` on a GPU (`pytest -m gpu`): construction under it gives the model that eager
construction on that device gives from the same seed, bit for bit (the CPU matrix is
tests/partition/test_construction.py). Parameters on the device, on the host and on NVMe, fp32, world
1: a lent machine has one GPU, and zeroinf gives each rank a GPU of its own (world 2 is the CPU
matrix's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests.partition._construction import build
from tests.partition.test_construction import _cfg, _differences, _snapshot
from zeroinf.topology import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="construction on CUDA needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
@pytest.mark.parametrize("model_name", ["gpt", "llama", "gpt2", "qwen2", "custom"])
def test_init_builds_the_eager_cuda_model_bitwise(model_name: str, tier: str, tmp_path: Path) -> None:
    topo = Topology.single(CUDA)
    cfg = _cfg(tier, "fp32", str(tmp_path))
    with torch.device(CUDA):  # eager construction on the device: the CUDA generator draws the values
        eager = build(model_name)
    zeroinf.shard(eager, cfg, topo)
    expected = _snapshot(eager)
    zeroinf.engine_of(eager).close()
    with zeroinf.init(cfg, topology=topo):
        built = build(model_name)
    zeroinf.shard(built, cfg, topo)
    got = _snapshot(built)
    zeroinf.engine_of(built).close()
    assert not _differences(expected, got), _differences(expected, got)


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_exact_masters_on_cuda_are_the_eager_models(model_name: str, tier: str, tmp_path: Path) -> None:
    """bf16 with `zeroinf.init(cfg, exact_masters=True)`: the gathered model is eager's and the fp32
    masters the optimizer takes are eager's unrounded ones (partition/park.py [Note: exact masters
    under zeroinf.init]), with the park on the device, the host or NVMe."""
    from tests.partition.test_construction import _masters

    topo = Topology.single(CUDA)
    cfg = _cfg(tier, "bf16", str(tmp_path))
    with torch.device(CUDA):
        eager = build(model_name)
    zeroinf.shard(eager, cfg, topo)
    expected, expected_masters = _snapshot(eager), _masters(eager)
    zeroinf.engine_of(eager).close()
    with zeroinf.init(cfg, topology=topo, exact_masters=True) as park:
        built = build(model_name)
    zeroinf.shard(built, cfg, topo)
    got, masters = _snapshot(built), _masters(built)
    zeroinf.engine_of(built).close()
    assert not _differences(expected, got), _differences(expected, got)
    assert torch.equal(masters, expected_masters)
    assert park.closed
