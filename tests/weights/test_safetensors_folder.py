"""`SafetensorsFolder` refuses damaged headers with a WeightsError naming the file (world 1, no group).

Before, a header entry without `shape`, with one data offset, or a header that was not a JSON
object stopped the load with a bare KeyError / ValueError / AttributeError (about one random header
byte flip in six), and a negative or overlapping byte range would have read other bytes as the
tensor. A seeded fuzz keeps it so: any damage to a header either raises WeightsError, renames a
key (which the loaders then name as missing), or leaves every tensor's bytes as they were.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import pytest
import torch

from zeroinf.weights.safetensors_folder import SafetensorsFolder, WeightsError


def _write(path: str, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _good_header() -> tuple[dict[str, Any], bytes]:
    a = torch.arange(6, dtype=torch.float32)
    b = torch.arange(4, dtype=torch.bfloat16)
    data = a.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    }
    return header, data


def _damage(entry: str, field: str | None, value: Any) -> tuple[dict[str, Any], bytes]:
    header, data = _good_header()
    if field is None:
        header[entry] = value
    else:
        header[entry][field] = value
    return header, data


DAMAGED = {
    "not-an-object": ([1, 2, 3], b""),
    "entry-not-an-object": _damage("a", None, [0, 24]),
    "no-shape": _damage("a", "shape", None),
    "one-offset": _damage("a", "data_offsets", [24]),
    "negative-offset": _damage("b", "data_offsets", [-8, 0]),
    "descending-offsets": _damage("b", "data_offsets", [32, 24]),
    "negative-dimension": _damage("a", "shape", [-2, -3]),
    "bool-dimension": _damage("b", "shape", [True, 4]),
    "overlap": _damage("b", "data_offsets", [16, 24]),
    "unknown-dtype": _damage("b", "dtype", "F8_E9"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_header_is_refused_naming_the_file(tmp_path: Any, case: str) -> None:
    header, data = DAMAGED[case]
    if case == "overlap":  # same span length as "b" (8 bytes) so only the overlap is wrong
        header["b"]["shape"] = [4]
    path = str(tmp_path / "model.safetensors")
    if isinstance(header, dict):
        _write(path, header, data)
    else:
        raw = json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(WeightsError, match="model.safetensors"):
        SafetensorsFolder(path)


def test_the_undamaged_file_reads_back(tmp_path: Any) -> None:
    header, data = _good_header()
    path = str(tmp_path / "model.safetensors")
    _write(path, header, data)
    folder = SafetensorsFolder(path)
    try:
        assert torch.equal(folder.read("a"), torch.arange(6, dtype=torch.float32).view(2, 3))
        assert torch.equal(folder.read("b"), torch.arange(4, dtype=torch.bfloat16))
    finally:
        folder.close()


def test_random_header_damage_never_escapes_as_another_error(tmp_path: Any) -> None:
    header, data = _good_header()
    good = str(tmp_path / "good.safetensors")
    _write(good, header, data)
    raw = open(good, "rb").read()
    header_end = 8 + struct.unpack("<Q", raw[:8])[0]
    expected = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.arange(4, dtype=torch.bfloat16)}
    rng = random.Random(0)
    outcomes: dict[str, int] = {"refused": 0, "renamed": 0, "same": 0}
    for trial in range(300):
        damaged = bytearray(raw)
        for _ in range(rng.randint(1, 2)):
            pos = rng.randrange(header_end)
            if rng.random() < 0.5:
                damaged[pos] ^= 1 << rng.randrange(8)
            else:
                damaged[pos] = rng.choice(b'{}[]",:-0123456789aZ ')
        path = str(tmp_path / f"bad{trial}.safetensors")
        with open(path, "wb") as f:
            f.write(damaged)
        try:
            folder = SafetensorsFolder(path)
        except WeightsError as e:
            assert path in str(e), str(e)
            outcomes["refused"] += 1
            continue
        try:
            if set(folder) != set(expected):
                outcomes["renamed"] += 1
                continue
            for key, want in expected.items():
                got = folder.read(key)
                assert got.dtype == want.dtype and torch.equal(got, want), (trial, key, got)
            outcomes["same"] += 1
        finally:
            folder.close()
    assert outcomes["refused"] > 150, outcomes  # the damage did reach the checks


@pytest.mark.parametrize("index", ['{"weight_map": [1]}', '{"weight_map": {"a": 3}}', '{"metadata": {}}', "[1]", "{"])
def test_a_damaged_index_is_refused_naming_it(tmp_path: Any, index: str) -> None:
    header, data = _good_header()
    _write(str(tmp_path / "model-00001-of-00001.safetensors"), header, data)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(WeightsError, match="model.safetensors.index.json: not a safetensors index"):
        SafetensorsFolder(str(tmp_path))


def test_a_folder_with_both_layouts_loads_the_single_file_as_transformers_does(tmp_path: Any, caplog: Any) -> None:
    """A `model.safetensors` beside an index (an earlier save left one behind): transformers loads
    the single file, so zeroinf does too (`from_pretrained` must equal its load), and says so."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.ones(3)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    with caplog.at_level("WARNING", logger="zeroinf.weights"):
        folder = SafetensorsFolder(tmp_path)
    try:
        assert torch.equal(folder.read("w"), torch.zeros(3))
    finally:
        folder.close()
    assert "both model.safetensors and model.safetensors.index.json" in caplog.text


def test_a_save_removes_the_weights_files_an_earlier_save_left(tmp_path: Any) -> None:
    """Writing shards removes an earlier `model.safetensors` (which would be loaded instead), writing
    one file removes an earlier index and its shards; other files stay."""
    from zeroinf.weights.export import write_safetensors_files

    entries = [(f"t{i}", (4,), torch.float32) for i in range(3)]
    produce = lambda i: torch.full((4,), float(i))  # noqa: E731
    for name in ("model.safetensors", "adapter_model.safetensors", "notes.txt", "model.safetensors.bak"):
        (tmp_path / name).write_bytes(b"old")
    write_safetensors_files(tmp_path, entries, produce, max_shard_bytes=16)
    shards = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model-"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert not (tmp_path / "model.safetensors").exists()
    write_safetensors_files(tmp_path, entries[:2], produce, max_shard_bytes=10**6)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["adapter_model.safetensors", "model.safetensors", "model.safetensors.bak", "notes.txt"], left
    folder = SafetensorsFolder(tmp_path)
    try:
        assert torch.equal(folder.read("t1"), torch.ones(4))
    finally:
        folder.close()
