"""`zeroinf finetune` end to end, as a user runs it (real `python -m zeroinf` processes).

A small Llama is saved with `save_pretrained` beside a byte-level BPE tokenizer trained in a second
on the embedded corpus, and a .jsonl file of documents is written. LoRA, stage 3, parameters on
NVMe: the loss goes down; `--out` loads with `AutoModelForCausalLM.from_pretrained` and generates,
with the adapters merged (its weights differ from the base exactly where adapters were); a run
resumed from the step-6 checkpoint continues with losses bitwise equal to the uninterrupted run.
A LLaVA folder fine-tunes on the same text, its `--out` loading as transformers' VLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
VOCAB = 320


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from zeroinf.data import load_corpus

    root = tmp_path_factory.mktemp("finetune")
    text = load_corpus(None, 400_000).numpy().tobytes().decode("utf-8", errors="ignore")
    docs = [text[i : i + 2000] for i in range(0, len(text), 2000)][:150]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, pad_token_id=None,
    ))
    model.save_pretrained(root / "base", safe_serialization=True)
    tokenizer.save_pretrained(root / "base")
    with open(root / "data.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    # every unit sharded (a model this small would otherwise stay resident) so NVMe is really used
    (root / "engine.json").write_text(json.dumps({"stage": 3, "persist_threshold_bytes": 0, "grad_clip_norm": 1.0}))
    return root


def _finetune(root: Path, name: str, *extra: str) -> dict[str, Any]:
    report = root / f"{name}.json"
    nvme = root / f"{name}-swap"
    nvme.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "zeroinf", "finetune", "--model", str(root / "base"), "--data", str(root / "data.jsonl"),
        "--lora-rank", "4", "--steps", "12", "--seq-len", "32", "--batch", "4", "--lr", "5e-2", "--warmup", "2",
        "--config", str(root / "engine.json"), "--offload-params", "nvme", "--nvme-dir", str(nvme), "--dtype", "fp32",
        "--report", str(report), "--no-progress", *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def runs(workspace: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    full = _finetune(
        workspace, "full", "--out", str(workspace / "tuned"), "--save-every", "6", "--save-dir", str(workspace / "ck")
    )
    resumed = _finetune(workspace, "resumed", "--resume", str(workspace / "ck" / "step_00000006"))
    return full, resumed


def test_loss_decreases(workspace: Path, runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    losses = runs[0]["losses"]
    assert len(losses) == 12
    # a fresh batch every step: compare means of three, not single steps
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    # and without the batch-to-batch noise: the tuned model against the base on the same documents
    # (12 LoRA steps on a random model move the loss by ~0.08 nats here; the margin is a sanity bound,
    # since how far it moves depends on the machine's kernels and the transformers release)
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tuned")
    docs = [json.loads(line)["text"] for line in (workspace / "data.jsonl").read_text().splitlines()[:16]]
    ids = torch.stack([torch.tensor(tokenizer(doc)["input_ids"][:32]) for doc in docs])
    held = {}
    for name in ("base", "tuned"):
        model = AutoModelForCausalLM.from_pretrained(workspace / name, dtype=torch.float32)
        with torch.no_grad():
            held[name] = model(ids, labels=ids).loss.item()
    assert held["tuned"] < held["base"] - 0.02, held


def test_resume_continues_bitwise(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    full, resumed = runs
    assert resumed["start_step"] == 6
    assert resumed["losses"] == full["losses"][6:]


def test_out_folder_loads_generates_and_holds_the_merged_weights(
    workspace: Path, runs: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tuned = AutoModelForCausalLM.from_pretrained(workspace / "tuned", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(workspace / "base", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(workspace / "tuned")
    ids = tokenizer("def main(", return_tensors="pt")["input_ids"]
    out = tuned.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] > ids.shape[1]
    tuned_state, base_state = tuned.state_dict(), base.state_dict()
    assert tuned_state.keys() == base_state.keys()
    changed = {k for k in base_state if not torch.equal(tuned_state[k], base_state[k])}
    linear = {k for k in base_state if k.endswith("proj.weight")}
    assert changed == linear, sorted(changed ^ linear)  # all-linear adapters: every projection moved


def test_report_has_a_step_timeline_and_the_prediction(runs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    step = runs[0]["step_report"]
    page = Path(step["timeline_html"]).read_text()
    assert "<svg" in page and "backward" in page
    assert Path(step["trace_json"]).is_file()
    predicted = step["predicted"]["peak_bytes"]  # from the unit plan the engine built (frozen base units)
    assert predicted["nvme"] > 0
    measured = step["measured_bytes"]  # the ledger's peaks of the step the timeline shows
    for tier in ("device", "host", "nvme"):
        assert abs(predicted[tier] - measured[tier]) <= 0.05 * max(measured[tier], 1), (tier, predicted, measured)


@pytest.mark.parametrize(("settings", "fragment"), [
    ({"format": "csv"}, "--format 'csv': use text, jsonl or auto"),
    ({"steps": 3, "epochs": 1.0}, "give --steps or --epochs, not both"),
    ({"lora_rank": -1}, "--lora-rank -1: use 0 (full fine-tune) or a positive rank"),
    ({"epochs": 0.0}, "epochs = 0.0 (--epochs) is invalid"),
    ({"save_every": 5}, "--save-every 5 needs --save-dir"),
    ({"data": []}, "--data: give at least one .txt or .jsonl file"),
    ({"log_interval": 0}, "log_interval = 0 is invalid"),
    ({"min_lr_ratio": -0.1}, "min_lr_ratio = -0.1 is invalid"),
])
def test_bad_finetune_settings_are_refused_by_name(settings: dict[str, Any], fragment: str) -> None:
    from zeroinf.finetune import FinetuneArgs

    with pytest.raises(ValueError) as info:
        FinetuneArgs(**{"model": "m", "data": ["a.txt"], **settings})
    assert fragment in str(info.value), str(info.value)


def test_bad_documents_are_refused_naming_file_and_line(tmp_path: Path) -> None:
    from zeroinf.finetune import read_documents, tokenize

    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n\n{"text": "b", "id": 1}\n')
    assert read_documents([str(good)]) == ["a", "b"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a JSON line"):
        read_documents([str(broken)])
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match=r"other.jsonl:1: no text field 'text' \(set --text-field\)"):
        read_documents([str(other)])
    assert read_documents([str(other)], text_field="body") == ["a"]
    with pytest.raises(ValueError, match=r"no tokenizer files and a vocabulary of 100 < 256 bytes"):
        tokenize(["abc"], str(tmp_path), vocab_size=100)



def test_a_vlm_is_fine_tuned_on_text(workspace: Path) -> None:
    """A LLaVA folder (its vocabulary in the text config; no causal-LM class in transformers) fine-tunes
    on the same text with LoRA: it stopped reading `config.vocab_size`, then in AutoModelForCausalLM.
    `--out` loads as transformers' image-text-to-text model, the language model's weights changed."""
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as Llava

    from tests.weights.test_hf_conversion import _differences

    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                              image_size=32, patch_size=8)
    torch.manual_seed(0)
    base = workspace / "llava"
    Llava(LlavaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)).save_pretrained(base)
    report = workspace / "llava.json"
    cmd = [sys.executable, "-m", "zeroinf", "finetune", "--model", str(base), "--data", str(workspace / "data.jsonl"),
           "--lora-rank", "4", "--steps", "2", "--seq-len", "32", "--batch", "2", "--lr", "1e-2", "--dtype", "fp32",
           "--out", str(workspace / "llava-tuned"), "--report", str(report), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = AutoModelForImageTextToText.from_pretrained(workspace / "llava-tuned").state_dict()
    changed = _differences(tuned, AutoModelForImageTextToText.from_pretrained(base).state_dict())
    assert changed and all(k.startswith("model.language_model.") for k in changed), changed
