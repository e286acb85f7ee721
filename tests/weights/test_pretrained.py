"""`zeroinf.from_pretrained` and `zeroinf.load_weights` against Hugging Face's own loading.

Folders are written by `save_pretrained` (no hub): GPT-2 (tied), Llama (untied) and Qwen2 (tied),
each in fp32 and bf16 and as one file or several shards. For each folder x stage-3 parameter tier
{device, host, nvme} x world {1, 2} (one spawned group), the sharded model's gathered `state_dict`
and buffers equal `AutoModelForCausalLM.from_pretrained(folder, dtype=fp32)` bitwise, the logits
agree within 1e-5, tied embeddings stay tied, the fp32 masters an optimizer takes are the stored
values, and `num_parameters()` counts as Hugging Face's on the plain model. `load_weights` streams
the same files into a sharded model of another seed (and a plain module's safetensors into a
sharded non-HF module). `resize_token_embeddings` in `prepare=` (its
old rows read from the files on demand) equals Hugging Face's load followed by the same resize,
bitwise. Bad folders are refused naming the key or file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests.partition._construction import VOCAB, build
from zeroinf.weights import WeightsError

FOLDERS = [  # (arch, dtype saved, max_shard_size)
    ("gpt2", torch.float32, "1GB"),
    ("gpt2", torch.bfloat16, "20KB"),
    ("llama", torch.float32, "20KB"),
    ("llama", torch.bfloat16, "1GB"),
    ("qwen2", torch.bfloat16, "20KB"),
    ("qwen2", torch.float32, "1GB"),
]
TIERS = ["device", "host", "nvme"]


def _save(root: str) -> list[str]:
    paths = []
    for arch, dtype, shard in FOLDERS:
        path = os.path.join(root, f"{arch}-{str(dtype)[6:]}-{shard}")
        build(arch, seed=11).to(dtype).save_pretrained(path, safe_serialization=True, max_shard_size=shard)
        paths.append(path)
    return paths


def _cfg(tier: str, folder: str) -> zeroinf.Config:
    offload = zeroinf.OffloadConfig(params=tier, nvme_dir=folder if tier == "nvme" else None)
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)


def _compare(path: str, tier: str, rank: int, swap_root: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    swap = os.path.join(swap_root, f"{os.path.basename(path)}-{tier}-rank{rank}")
    os.makedirs(swap, exist_ok=True)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours = zeroinf.from_pretrained(path, _cfg(tier, swap))
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    ref_buffers, our_buffers = dict(reference.named_buffers()), dict(ours.named_buffers())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logit_diff = (ours(ids).logits - reference(ids).logits).abs().max().item()
    opt = zeroinf.AdamW(ours, lr=1e-3)
    engine = zeroinf.engine_of(ours)
    masters_ok = True
    for ui, unit in enumerate(engine.units):
        master = opt.states.read_unit(ui).master
        for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
            name = unit.param_names[piece.slot_index]
            stored = ref_state[name].reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
            got = master[piece.start - unit.owned_start : piece.end - unit.owned_start]
            masters_ok &= torch.equal(got.cpu(), stored.float())
    ours.lm_head.requires_grad_(False)  # a frozen part, for only_trainable= (tied: the embeddings too)
    reference.lm_head.requires_grad_(False)
    counts = [{"only_trainable": t, "exclude_embeddings": e} for t in (False, True) for e in (False, True)]
    out = {
        "num_parameters": [ours.num_parameters(**kw) for kw in counts],
        "num_parameters_expected": [reference.num_parameters(**kw) for kw in counts],
        "param_diffs": [k for k in ref_state if k not in our_state or not torch.equal(our_state[k], ref_state[k])],
        "buffer_diffs": [k for k in ref_buffers if not torch.equal(our_buffers[k], ref_buffers[k])],
        "logit_diff": logit_diff, "masters_ok": masters_ok, "eval_mode": not ours.training,
        "tied": ours.get_output_embeddings().weight is ours.get_input_embeddings().weight,
        "tied_expected": reference.get_output_embeddings().weight is reference.get_input_embeddings().weight,
        "swap_left": sorted(f for f in os.listdir(swap) if "park" in f),
    }
    opt.close()
    engine.close()
    return out


def _load_weights_into_other_seed(path: str, rank: int, swap_root: str) -> bool:
    """`load_weights` into a model already sharded (params on NVMe), built from another seed."""
    from transformers import AutoModelForCausalLM

    swap = os.path.join(swap_root, f"load-rank{rank}")
    os.makedirs(swap, exist_ok=True)
    model = zeroinf.shard(build("llama", seed=99), _cfg("nvme", swap))
    opt = zeroinf.AdamW(model, lr=1e-3)  # masters exist already: load_weights must overwrite them
    zeroinf.load_weights(model, path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    ok = all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    for group in opt.param_groups:
        group["lr"] = 0.0
    loss = model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss
    loss.backward()
    opt.step()  # lr 0: the parameters are rewritten from the masters, which must hold the loaded values
    ok &= all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    opt.close()
    zeroinf.engine_of(model).close()
    return ok


def _resized_in_prepare(path: str, rank: int, swap_root: str) -> list[str]:
    """Keys whose values differ from Hugging Face's load + resize (empty: all equal)."""
    from transformers import AutoModelForCausalLM

    def resize(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)  # the new rows are drawn around the old ones' mean (mean_resizing)
        model.resize_token_embeddings(VOCAB + 12)  # type: ignore[operator]
        return model

    reference = resize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).state_dict()
    model = zeroinf.from_pretrained(path, _cfg("nvme", os.path.join(swap_root, f"resize-{rank}")), prepare=resize)
    state = model.state_dict()
    zeroinf.engine_of(model).close()
    return [k for k, v in reference.items() if k not in state or not torch.equal(state[k], v)]


def run(rank: int, world: int, paths: list[str], swap_root: str) -> dict[str, Any]:
    results: dict[str, Any] = {
        f"{os.path.basename(p)}/{tier}": _compare(p, tier, rank, swap_root) for p in paths for tier in TIERS
    }
    llama = next(p for p in paths if "llama" in p and "float32" in p)
    results["load_weights"] = _load_weights_into_other_seed(llama, rank, swap_root)
    results["resized"] = {
        os.path.basename(p): _resized_in_prepare(p, rank, swap_root) for p in paths if "float32" in p
    }
    return results


@pytest.fixture(scope="module")
def folders() -> Any:
    root = tempfile.mkdtemp(prefix="zeroinf-pretrained-")
    try:
        yield root, _save(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest, folders: tuple[str, list[str]]) -> tuple[int, list[dict]]:
    root, paths = folders
    swap_root = tempfile.mkdtemp(dir=root)
    world = request.param
    if world == 1:
        return world, [run(0, 1, paths, swap_root)]
    return world, run_ranks(run, world, paths, swap_root, timeout_s=300)


def test_from_pretrained_equals_hugging_face(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    for rank, by_case in enumerate(per_rank):
        for case, r in by_case.items():
            if case in ("load_weights", "resized"):
                continue
            where = f"world {world} rank {rank} {case}"
            assert r["param_diffs"] == [] and r["buffer_diffs"] == [], f"{where}: {r}"
            assert r["logit_diff"] <= 1e-5, f"{where}: logits differ by {r['logit_diff']}"
            assert r["masters_ok"], f"{where}: the fp32 masters are not the stored values"
            assert r["tied"] == r["tied_expected"] and r["eval_mode"], f"{where}: {r}"
            assert r["swap_left"] == [], f"{where}: a park file was left: {r['swap_left']}"
            # Hugging Face's count (and the Trainer's total_flos from it) read the stage-3 placeholders' 0
            assert r["num_parameters"] == r["num_parameters_expected"], f"{where}: {r['num_parameters']}"


def test_load_weights_into_a_sharded_model(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    assert all(r["load_weights"] for r in per_rank), f"world {world}"


def test_load_weights_into_a_module_that_is_not_hugging_face(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    from tests.partition.test_init import Net

    torch.manual_seed(1)
    source = Net()
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors"))
    torch.manual_seed(2)
    model = zeroinf.shard(Net(), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    zeroinf.load_weights(model, tmp_path / "model.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, source.state_dict()[k]), k


# -- bad input ----------------------------------------------------------------------------------------
@pytest.fixture()
def llama_folder(folders: tuple[str, list[str]], tmp_path: Any) -> str:
    _, paths = folders
    src = next(p for p in paths if "llama" in p and "float32" in p)  # sharded: several files + index
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    return str(dst)


def _index(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return json.load(f)


def test_a_missing_shard_file_is_named(llama_folder: str) -> None:
    victim = sorted(set(_index(llama_folder)["weight_map"].values()))[1]
    os.remove(os.path.join(llama_folder, victim))
    with pytest.raises(WeightsError, match=victim):
        zeroinf.from_pretrained(llama_folder)


def test_a_truncated_file_is_named(llama_folder: str) -> None:
    victim = os.path.join(llama_folder, sorted(set(_index(llama_folder)["weight_map"].values()))[0])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    with pytest.raises(WeightsError, match=r"truncated"):
        zeroinf.from_pretrained(llama_folder)


def test_a_key_mismatch_is_named(llama_folder: str, tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    files = sorted(set(_index(llama_folder)["weight_map"].values()))
    target = os.path.join(llama_folder, files[0])
    tensors = load_file(target)
    old = next(iter(tensors))
    tensors[old.replace("weight", "wieght")] = tensors.pop(old)
    save_file(tensors, target, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=rf"in no weights file.*{old}"):
        zeroinf.from_pretrained(llama_folder)


def test_a_shape_mismatch_is_named(llama_folder: str) -> None:
    with open(os.path.join(llama_folder, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] *= 2
    with open(os.path.join(llama_folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightsError, match=r"mlp\.\w+_proj\.weight.*has shape"):
        zeroinf.from_pretrained(llama_folder)


def test_a_folder_that_is_not_hugging_face_is_refused(tmp_path: Any, llama_folder: str) -> None:
    with pytest.raises(WeightsError, match="no config.json"):
        zeroinf.from_pretrained(tmp_path)
    for name in os.listdir(llama_folder):
        if name.endswith(".json") and name != "config.json":
            os.remove(os.path.join(llama_folder, name))
    for name in os.listdir(llama_folder):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(llama_folder, name))
    with pytest.raises(WeightsError, match="not a Hugging Face weights folder"):
        zeroinf.from_pretrained(llama_folder)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"quantization_config": object()}, ["quantization_config= is not taken: quantized bases", "offload"]),
        ({"load_in_4bit": True, "device_map": "auto"}, ["load_in_4bit=", "device_map= is not taken: zeroinf places"]),
        ({"revision": "main"}, ["revision= is not taken: a local folder is read"]),
    ],
)
def test_arguments_only_transformers_loader_takes_are_refused_naming_what_does_the_job(
    llama_folder: str, kwargs: dict[str, Any], names: list[str]
) -> None:
    """They went to `from_config`, which stopped with "__init__() got an unexpected keyword argument"."""
    with pytest.raises(TypeError) as refused:
        zeroinf.from_pretrained(llama_folder, **kwargs)
    assert all(name in str(refused.value) for name in names), str(refused.value)


def test_a_quantized_checkpoint_is_refused(llama_folder: str) -> None:
    with open(os.path.join(llama_folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    with open(os.path.join(llama_folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(WeightsError, match=r"a quantized checkpoint .*'gptq'.*unquantized release"):
        zeroinf.from_pretrained(llama_folder)


def test_resize_token_embeddings_in_prepare_equals_hugging_face(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    for rank, r in enumerate(per_rank):
        assert len(r["resized"]) == 3, r["resized"]
        for folder, differing in r["resized"].items():
            assert differing == [], (world, rank, folder, differing)


def kept_fp32_load(folder: Any, device: torch.device | None = None) -> dict[Any, tuple[list[str], list[str], float]]:
    """A tiny DeepSeek-V3 saved in `folder` in fp32, loaded in bf16 by Hugging Face and by
    `zeroinf.from_pretrained` (stage 3, shards on the host) with `keep_fp32` "auto" and ():
    per setting, the names Hugging Face keeps in fp32, the state entries that differ from its load
    (dtype or value), and the largest logit difference. On `device` (the CPU when None)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # a bias that bf16 does not hold exactly (it is built as zeros)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(0.1, 0.7, b.numel()) / 3)
    model.save_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = reference(ids).logits.float()
    ref_state = reference.state_dict()
    kept = sorted(k for k, v in ref_state.items() if v.dtype == torch.float32)
    out: dict[Any, tuple[list[str], list[str], float]] = {}
    for keep in ("auto", ()):
        offload = zeroinf.OffloadConfig(params="host")
        cfg = zeroinf.Config(stage=3, param_dtype="bf16", persist_threshold_bytes=0, offload=offload, keep_fp32=keep)
        ours = zeroinf.from_pretrained(folder, cfg)
        state = ours.state_dict()
        with torch.no_grad():
            diff = (ours(ids).logits.float() - expected).abs().max().item()
        zeroinf.engine_of(ours).close()
        differs = sorted(
            k for k, v in ref_state.items() if v.dtype != state[k].dtype or not torch.equal(v, state[k].to(v.dtype))
        )
        out[keep] = (kept, differs, diff)
    return out


KEPT_BY_DEEPSEEK = ["model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"]


def test_a_bf16_load_keeps_what_the_model_keeps_in_fp32(tmp_path: Any) -> None:
    """DeepSeek-V3 declares its router's gate weight and score bias fp32 (`_keep_in_fp32_modules_strict`):
    Hugging Face's bf16 load keeps them, and so does zeroinf's (precision.py [Note: parameters the
    model keeps in fp32]): the same state bit for bit, dtypes included, and the same logits. Rounded
    to bf16 (`keep_fp32=()`, what `module.to(bf16)` does), the logits differ by 3e-2 here."""
    runs = kept_fp32_load(tmp_path / "ds")
    kept, differs, diff = runs["auto"]
    assert kept == KEPT_BY_DEEPSEEK
    assert differs == [] and diff == 0.0, (differs, diff)
    _, differs, diff = runs[()]
    assert differs == KEPT_BY_DEEPSEEK and diff > 1e-3, (differs, diff)
