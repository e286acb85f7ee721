"""`zeroinf plan`: the table, the JSON, Hugging Face configs read without weights, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zeroinf
from zeroinf import cli
from zeroinf.memory import format_decimal_bytes

SRC = str(Path(zeroinf.__file__).resolve().parents[1])
LLAMA_70B = {  # Llama 3.1 70B's config.json, the fields that shape the model
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
TINY_LLAMA = {**LLAMA_70B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


@pytest.fixture(autouse=True)
def _no_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ZEROINF_CACHE_DIR", str(tmp_path / "cache"))


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_lists_placements_and_marks_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(["plan", "--model", "tiny", "--world", "2", "--tokens", "512"], capsys)
    assert code == 0
    assert "fastest that fits" in out and "yes*" in out
    assert "st params optim  grads  ckpt" in out and "step s" in out and "bound" in out
    assert "machine profile: conservative defaults; run `zeroinf plan --measure`" in out


def test_an_nvme_placement_states_its_ssd_writes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The writes a step makes to the SSD, and over 10,000 steps (drives are rated in TB written)."""
    argv = ["plan", "--model", "small", "--stage", "3", "--offload-params", "nvme", "--offload-optimizer", "nvme",
            "--nvme-dir", str(tmp_path)]
    code, out, _ = _main(argv, capsys)
    assert code == 0
    code, js, _ = _main([*argv, "--json"], capsys)
    written = json.loads(js)["best"]["time"]["nvme_written_bytes"]
    assert written > 0
    per_step, per_10k = format_decimal_bytes(written), format_decimal_bytes(written * 10_000)
    assert f"nvme per rank in that placement: {per_step} written a step, {per_10k} per 10,000 steps" in out, out
    assert "rated TBW" in out


def test_batch_takes_the_default_sequence_and_nvme_tiers_the_temp_folder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--batch alone used to stop with "--batch needs --seq-len", and an explicit nvme tier without
    --nvme-dir with "set nvme_dir", where --help promises the model's context and the temp folder."""
    code, out, _ = _main(
        ["plan", "--model", "tiny", "--batch", "8", "--stage", "2", "--offload-optimizer", "nvme", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert data["workload"]["tokens_per_step"] == 8 * 128  # tiny's context: 128
    assert {c["placement"]["optimizer"] for c in data["candidates"]} == {"nvme"}


def test_json_is_one_object_for_programs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _main(
        ["plan", "--model", "small", "--stage", "3", "--nvme-dir", str(tmp_path), "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert data["param_count"] > 3e6 and data["best"]["fits"]
    assert {c["placement"]["stage"] for c in data["candidates"]} == {3}
    first = data["candidates"][0]
    assert set(first["peak_bytes"]) == {"device", "host", "nvme"}
    assert set(first["time"]) >= {"compute_s", "collectives_s", "nvme_io_s", "optimizer_s", "step_s", "bound"}
    assert data["machine"]["measured"] is False


def test_hf_config_is_read_without_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    code, out, _ = _main(["plan", "--hf", str(tmp_path), "--json", "--seq-len", "128"], capsys)
    assert code == 0
    data = json.loads(out)
    expected = 512 * 64 * 2 + 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    assert data["param_count"] == expected
    assert data["workload"]["seq_len"] == 128
    assert os.listdir(tmp_path) == ["config.json"]


def test_70b_llama_answers_in_seconds_without_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "zeroinf", "plan", "--hf", str(tmp_path), "--nvme-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": SRC, "ZEROINF_CACHE_DIR": str(tmp_path / "cache")},
    )
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM" in done.stdout and "70.6B parameters" in done.stdout
    assert "fastest that fits" in done.stdout or "nothing fits" in done.stdout
    print(f"zeroinf plan --hf <70B Llama config>: {seconds:.1f} s (the issue asks < 5 s on an idle machine)")
    assert seconds < 60


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--hf", "{d}/nope"], "no config.json there"),
        (["plan", "--hf", "{d}/noconfig"], "no config.json there"),
        (["plan", "--hf", "{d}/no_type.json"], "has no model_type"),
        (["plan", "--hf", "{d}/broken.json"], "not valid JSON"),
        (["plan", "--model", "tiny", "--world", "0"], "--world 0 is invalid"),
        (["plan", "--model", "tiny", "--batch", "0"], "--batch 0 is invalid"),
        (["plan", "--model", "tiny", "--tokens", "0"], "--tokens 0 is invalid"),
    ],
)
def test_bad_inputs_are_one_line_errors(
    argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "no_type.json").write_text('{"hidden_size": 8}')
    (tmp_path / "broken.json").write_text("{not json")
    code, _, err = _main([a.replace("{d}", str(tmp_path)) for a in argv], capsys)
    assert code == 2
    assert fragment in err and len(err.strip().splitlines()) == 1, err


def test_plan_accepts_a_module_built_under_init() -> None:
    from zeroinf.models.gpt import GPT, GPTConfig

    cfg = zeroinf.Config(stage=3)
    with zeroinf.init(cfg):
        model = GPT(GPTConfig(seq_len=64, n_layer=3, n_head=2, d_model=128))
    result = zeroinf.plan(model, cfg, seq_len=64, tokens_per_step=128)
    assert len(result.estimates) == 1 and result.pass_facts is not None
    assert result.param_count == sum(p.numel() for p in model.parameters())
    custom = zeroinf.plan(torch_stack(), zeroinf.Config(stage=3))  # a module it cannot call: bytes only
    assert custom.pass_facts is None and any("example_inputs" in n for n in custom.notes)


def torch_stack() -> object:
    from torch import nn

    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])


def _nvme_params_host_states_argv(tmp_path: Path) -> list[str]:
    """`zeroinf plan` of an 8-layer Llama, parameters on NVMe, optimizer states on the host, fp32."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 1024,
                                                    "num_hidden_layers": 8}))
    return ["plan", "--hf", str(folder), "--seq-len", "64", "--stage", "3", "--offload-params", "nvme",
            "--offload-optimizer", "host", "--offload-gradients", "device", "--checkpointing", "off", "--dtype", "fp32",
            "--nvme-dir", str(tmp_path / "swap")]


def test_max_host_bytes_shows_the_host_nvme_split(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A Llama whose optimizer states (12 B/param) exceed the cap: the plan keeps part on the host."""
    argv = [*_nvme_params_host_states_argv(tmp_path), "--max-host-bytes", "100MiB"]
    code, out, _ = _main([*argv, "--json"], capsys)
    assert code == 0
    best = json.loads(out)["candidates"][0]
    split = best["optimizer_split"]
    assert split["host_units"] > 0 and split["nvme_units"] > 0
    assert best["peak_bytes_by_tag"]["host"]["optimizer_state"] == 12 * split["host_numel"]
    code, out, _ = _main(argv, capsys)
    assert code == 0 and "split" in out and "optimizer states split" in out


def test_param_cache_is_planned_as_host_bytes_and_saves_reads(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    """A cache holding every parameter shard: its bytes on the host, and no shard read from NVMe in a steady step."""
    argv = [*_nvme_params_host_states_argv(tmp_path), "--json"]
    results = {}
    for cache in (None, "1GiB"):
        code, out, _ = _main([*argv, *(["--param-cache", cache] if cache else [])], capsys)
        assert code == 0
        results[cache] = json.loads(out)["candidates"][0]
    plain, cached = results[None], results["1GiB"]
    assert "param_cache" not in plain["peak_bytes_by_tag"]["host"]
    assert cached["peak_bytes_by_tag"]["host"]["param_cache"] > 0
    # Without a cache, each shard is read for forward and again for backward; with it, never (steady step).
    assert cached["time"]["nvme_read_bytes"] == 0 < plain["time"]["nvme_read_bytes"]
