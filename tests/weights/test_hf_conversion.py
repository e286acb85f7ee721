"""Folders whose stored tensors are not the model's parameters (weights/hf_conversion.py).

`ComposedTensor` ranges against torch.stack / torch.cat / torch.split / torch.chunk on real files:
every range of a stack, of a concatenation along each dimension, of a concatenation of stacks (the
experts' gate_up_proj) and of each piece of a split (a fused qkv, along each dimension, uneven
chunks) reads exactly the elements torch's result holds there; so does every range of a
`TransposedTensor` (read by blocks) against torch.transpose(...).contiguous().

Hugging Face folders as `save_pretrained` writes them under transformers 5 (the Hub layout, checked
below: one tensor per expert and matrix, Mixtral's `block_sparse_moe`, GPT-NeoX's `embed_out`):
Mixtral (fp32, several files), Qwen2-MoE (bf16, shared expert), GPT-NeoX (a renamed head), HRM
(fused [gate|q|k|v] and [gate|up] rows chunked, several files) and Sarvam-MoE (a GQA qkv split by
each target's size, bf16); Qwen3-VL-MoE with its experts stored transposed, at world 1 and 2. For
each, at world 1 and 2 (one spawned group) and stage-3 parameters on the host and on NVMe, the
gathered state_dict equals `AutoModelForCausalLM.from_pretrained` bitwise, the logits agree, and the
fp32 masters an optimizer takes are the stored values (tests/weights/test_pretrained.py's check),
and `zeroinf.load_weights` of the Mixtral folder into a sharded model of another seed equals it too;
with the default settings (small parameters read whole), and with peft's LoRA at stages 0-1 (frozen
base weights read whole), the values are equal to Hugging Face's load (then the same LoRA) too.
Mixtral loaded at stage 3 trains as Hugging Face's own load does under torch's AdamW. A conversion
zeroinf cannot read by ranges is refused naming the parameter and the operation.

Saving goes the other way, as transformers' `save_pretrained` does: `zeroinf.save_pretrained` of
the loaded Mixtral writes the folder's own keys and values back (experts one tensor each), and of a
Qwen2-MoE built from a config what Hugging Face's save_pretrained writes, at world 1 and 2; a
conversion joining two units' tensors falls back to the model's own layout with a warning. The
fine-tune writer (`--out`) merges LoRA on every linear layer and on both fused expert parameters
into what peft's `merge_and_unload()` + `save_pretrained` write, key for key and bitwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._hf import has_model_type, needs_model_type, peft_lora_on_parameters
from tests.partition._construction import VOCAB
from tests.weights.test_pretrained import _cfg, _compare
from zeroinf.weights import SafetensorsFolder, WeightsError
from zeroinf.weights.safetensors_folder import chunk_sizes, concatenate, permute_rows, split, stack, transpose

pytest.importorskip("transformers")


# -- ranges of composed tensors -------------------------------------------------------------------------
def _ranges_match(folder: SafetensorsFolder, composed: Any, expected: torch.Tensor) -> None:
    flat = expected.reshape(-1)
    n = flat.numel()
    g = torch.Generator().manual_seed(n)
    starts = torch.randint(0, n, (40,), generator=g).tolist()
    spans = [(0, n), (0, 1), (n - 1, 1)] + [(s, int(torch.randint(1, n - s + 1, (1,), generator=g))) for s in starts]
    assert composed.shape == tuple(expected.shape)
    for start, count in spans:
        out = torch.empty(count, dtype=expected.dtype)
        folder.start_read(composed, start, out).wait()
        assert torch.equal(out, flat[start : start + count]), (composed.key, start, count)


def test_stacks_and_concatenations_read_as_torch_builds_them(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"e{e}.{m}": torch.randn(6, 5, generator=g) for e in range(3) for m in ("w1", "w3")}
    tensors["other"] = torch.randn(6, 7, generator=g)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    folder = SafetensorsFolder(tmp_path)
    try:
        w1 = [folder[f"e{e}.w1"] for e in range(3)]
        w3 = [folder[f"e{e}.w3"] for e in range(3)]
        t1 = [tensors[f"e{e}.w1"] for e in range(3)]
        t3 = [tensors[f"e{e}.w3"] for e in range(3)]
        _ranges_match(folder, stack("s", w1), torch.stack(t1))
        for dim in (0, 1, -1):
            _ranges_match(folder, concatenate("c", [w1[0], w3[1]], dim), torch.cat([t1[0], t3[1]], dim))
        _ranges_match(folder, concatenate("wide", [w1[0], folder["other"]], 1), torch.cat([t1[0], tensors["other"]], 1))
        fused = concatenate("gate_up", [stack("a", w1), stack("b", w3)], 1)  # MergeModulelist, then Concatenate(1)
        _ranges_match(folder, fused, torch.cat([torch.stack(t1), torch.stack(t3)], 1))
        with pytest.raises(WeightsError, match="do not fit together"):
            concatenate("bad", [w1[0], folder["other"]], 0)
    finally:
        folder.close()


def test_splits_and_chunks_read_as_torch_cuts_them(tmp_path: Any) -> None:
    """A fused tensor split into the model's parameters (a qkv, Chunk or Split): each piece, and a
    piece of a stack, reads exactly the elements torch.split / torch.chunk give, along any dim."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {"qkv": torch.randn(10, 6, 3, generator=g), "e0": torch.randn(4, 5, generator=g),
               "e1": torch.randn(4, 5, generator=g)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    folder = SafetensorsFolder(tmp_path)
    try:
        qkv = tensors["qkv"]
        for dim in (0, 1, 2, -1):
            for sizes in ([qkv.shape[dim]], [1] * qkv.shape[dim], chunk_sizes(qkv.shape[dim], 3)):
                names = [f"p{i}" for i in range(len(sizes))]
                pieces = split(names, folder["qkv"], dim, sizes)
                for piece, expected in zip(pieces, torch.split(qkv, sizes, dim), strict=True):
                    _ranges_match(folder, piece, expected.contiguous())
        assert chunk_sizes(10, 3) == [len(t) for t in torch.chunk(torch.empty(10), 3)] == [4, 4, 2]
        assert chunk_sizes(6, 4) == [len(t) for t in torch.chunk(torch.empty(6), 4)] == [2, 2, 2]
        experts = stack("s", [folder["e0"], folder["e1"]])
        for piece, expected in zip(split(["a", "b"], experts, 1, [1, 3]), torch.split(torch.stack(
                [tensors["e0"], tensors["e1"]]), [1, 3], 1), strict=True):
            _ranges_match(folder, piece, expected.contiguous())
        with pytest.raises(WeightsError, match="cannot be split"):
            split(["a", "b"], folder["qkv"], 0, [4, 4])
        for dims in ((1, 2), (0, 2), (2, 0), (0, 1)):  # read by blocks of the dims from the first on
            _ranges_match(folder, transpose("t", folder["qkv"], *dims), qkv.transpose(*dims).contiguous())
        order = torch.randperm(qkv.shape[0], generator=g).tolist()
        _ranges_match(folder, permute_rows("p", folder["qkv"], order), qkv[order])
        stacked = torch.stack([tensors["e0"], tensors["e1"]])
        _ranges_match(folder, transpose("t", experts, 1, 2), stacked.mT.contiguous())
    finally:
        folder.close()


# -- Hugging Face folders in the Hub layout ---------------------------------------------------------------
def _build(arch: str, seed: int = 3) -> torch.nn.Module:
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32
    )
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=48, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_key_value_heads=2,
                                shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    elif arch == "hrm_text":  # fused [gate|q|k|v] and [gate|up] rows: Chunk(dim=0) into 4 and 2
        cfg = tf.AutoConfig.for_model(arch, **common, intermediate_size=48, num_key_value_heads=4)
    elif arch == "sarvam_moe":  # GQA [q|k|v] rows: Split(dim=0) by each target's size; experts stacked
        cfg = tf.AutoConfig.for_model(arch, **common, intermediate_size=48, num_key_value_heads=2, num_experts=4,
                                      moe_intermediate_size=24, num_experts_per_tok=2, first_k_dense_replace=1)
    else:
        cfg = tf.GPTNeoXConfig(**common, intermediate_size=64, tie_word_embeddings=False)
    return tf.AutoModelForCausalLM.from_config(cfg)


ALL_FOLDERS = [("mixtral", torch.float32, "20KB", "block_sparse_moe.experts.3.w3.weight"),
               ("qwen2_moe", torch.bfloat16, "1GB", "mlp.experts.3.up_proj.weight"),
               ("gpt_neox", torch.float32, "1GB", "embed_out.weight"),
               ("hrm_text", torch.float32, "20KB", "attn.gqkv_proj.weight"),
               ("sarvam_moe", torch.bfloat16, "1GB", "attention.query_key_value.weight")]
FOLDERS = [f for f in ALL_FOLDERS if has_model_type(f[0])]


@pytest.fixture(scope="module")
def folders() -> Any:
    root = tempfile.mkdtemp(prefix="zeroinf-hf-conversion-")
    try:
        paths = []
        for arch, dtype, shard, hub_key in FOLDERS:
            path = os.path.join(root, arch)
            _build(arch).to(dtype).save_pretrained(path, max_shard_size=shard)
            stored = SafetensorsFolder(path)
            assert any(k.endswith(hub_key) for k in stored), f"{arch}: not saved in the Hub layout ({list(stored)[:4]})"
            stored.close()
            paths.append(path)
        yield root, paths
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _trains_as_hugging_face(path: str, swap: str) -> float:
    """Largest difference in losses and weights over 3 steps: stage 3 on NVMe vs Hugging Face's load."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = zeroinf.from_pretrained(path, _cfg("nvme", swap))
    reference.train(), model.train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    opt = zeroinf.AdamW(model, lr=1e-2)
    worst = 0.0
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        opt.backward(loss)
        opt.step(), opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    ref_state = reference.state_dict()
    for k, v in model.state_dict().items():
        worst = max(worst, (v - ref_state[k]).abs().max().item())
    opt.close()
    zeroinf.engine_of(model).close()
    return worst


def _stored(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return {k: v for name in names for k, v in load_file(os.path.join(path, name)).items()}


def _differences(written: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(written) ^ set(expected)) or [k for k, v in expected.items() if not torch.equal(written[k], v)]


def _saved_in_the_hub_layout(path: str, rank: int, world: int, swap_root: str) -> dict[str, list[str]]:
    """`zeroinf.save_pretrained` of a loaded folder writes the folder's keys and values; of a model
    built from a config, what Hugging Face's own save_pretrained writes (keys that differ: none)."""
    model = zeroinf.from_pretrained(path, _cfg("nvme", os.path.join(swap_root, f"save-{rank}")))
    out = os.path.join(swap_root, f"resaved-w{world}")
    zeroinf.save_pretrained(model, out)
    zeroinf.engine_of(model).close()
    built = _build("qwen2_moe")
    plain = os.path.join(swap_root, f"plain-w{world}-r{rank}")
    built.save_pretrained(plain)
    sharded = zeroinf.shard(built, zeroinf.Config(stage=3, persist_threshold_bytes=0))
    from_config = os.path.join(swap_root, f"from-config-w{world}")
    zeroinf.save_pretrained(sharded, from_config)
    zeroinf.engine_of(sharded).close()
    if rank != 0:
        return {}
    return {"loaded": _differences(_stored(out), _stored(path)),
            "built": _differences(_stored(from_config), _stored(plain))}


def _default_config_differences(path: str, stage: int, lora: bool) -> list[str]:
    """Keys whose values differ from Hugging Face's load (then peft's LoRA on every linear layer, after
    the same seed), with the default persist threshold: small parameters, a renamed router or head
    among them, and at stages 0-2 the frozen base weights, are read whole outside units."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(5)
        return get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))  # type: ignore[return-value]

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = (prepare(reference) if lora else reference).state_dict()
    model = zeroinf.from_pretrained(path, zeroinf.Config(stage=stage), prepare=prepare if lora else None)
    state = model.state_dict()
    zeroinf.engine_of(model).close()
    return _differences(state, expected)


def _merged_export_differences(path: str, rank: int, world: int, swap_root: str) -> list[str]:
    """`zeroinf finetune --out`'s writer on a Mixtral with LoRA on every linear layer and on both
    fused expert parameters (peft wraps the experts module twice), against peft's
    `merge_and_unload()` of the same adapters on Hugging Face's load, then `save_pretrained`: the
    written keys and values (keys or values that differ: none)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from zeroinf.finetune import write_merged

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(6)
        lora = LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False,
                          target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        return get_peft_model(model, lora)  # type: ignore[return-value]

    model = zeroinf.from_pretrained(path, _cfg("nvme", os.path.join(swap_root, f"merge-{rank}")), prepare=prepare)
    out = os.path.join(swap_root, f"merged-w{world}")
    write_merged(model, out)
    zeroinf.engine_of(model).close()
    if rank != 0:
        return []
    merged = prepare(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).merge_and_unload()
    expected = os.path.join(swap_root, f"merged-by-peft-w{world}")
    merged.save_pretrained(expected)
    return _differences(_stored(out), _stored(expected))


def _load_weights_differences(path: str, rank: int, swap_root: str) -> list[str]:
    """`zeroinf.load_weights` of a Hub-layout folder (Mixtral's stacked experts; Sarvam-MoE's split
    qkv, sized by the full shapes of parameters that are placeholders now) into a model of another
    seed, sharded with parameters on NVMe, against Hugging Face's load (keys or values that differ: none)."""
    from transformers import AutoModelForCausalLM

    arch = os.path.basename(path)
    model = zeroinf.shard(_build(arch, seed=99), _cfg("nvme", os.path.join(swap_root, f"load-{arch}-{rank}")))
    zeroinf.load_weights(model, path)
    state = model.state_dict()
    zeroinf.engine_of(model).close()
    return _differences(state, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


def run(rank: int, world: int, paths: list[str], swap_root: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"{os.path.basename(p)}/{tier}": _compare(p, tier, rank, swap_root) for p in paths for tier in ("host", "nvme")
    }
    out["defaults"] = {
        f"{os.path.basename(p)}/stage{stage}{'/lora' if lora else ''}": _default_config_differences(p, stage, lora)
        for p in paths for stage, lora in ((0, True), (1, True), (3, False))
    }
    if world == 1:
        out["trained"] = _trains_as_hugging_face(paths[0], os.path.join(swap_root, "train"))
    out["saved"] = _saved_in_the_hub_layout(paths[0], rank, world, swap_root)
    out["merged"] = _merged_export_differences(paths[0], rank, world, swap_root) if peft_lora_on_parameters() else None
    out["load_weights"] = [d for p in (paths[0], paths[-1]) for d in _load_weights_differences(p, rank, swap_root)]
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def results(request: pytest.FixtureRequest, folders: tuple[str, list[str]]) -> tuple[int, list[dict]]:
    root, paths = folders
    swap_root = tempfile.mkdtemp(dir=root)
    if request.param == 1:
        return 1, [run(0, 1, paths, swap_root)]
    return 2, run_ranks(run, 2, paths, swap_root, timeout_s=300)


def test_hub_layout_loads_as_hugging_face_loads_it(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    for rank, by_case in enumerate(per_rank):
        for case, r in by_case.items():
            if case in ("trained", "saved", "defaults", "merged", "load_weights"):
                continue
            where = f"world {world} rank {rank} {case}"
            assert r["param_diffs"] == [] and r["buffer_diffs"] == [], f"{where}: {r}"
            assert r["logit_diff"] <= 1e-5, f"{where}: logits differ by {r['logit_diff']}"
            assert r["masters_ok"], f"{where}: the fp32 masters are not the stored values"
            assert r["swap_left"] == [], f"{where}: a park file was left: {r['swap_left']}"


def test_hub_layout_loads_with_default_settings(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    for rank, r in enumerate(per_rank):
        assert all(d == [] for d in r["defaults"].values()), f"world {world} rank {rank}: {r['defaults']}"


def test_load_weights_reads_the_hub_layout_into_a_sharded_model(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    assert all(r["load_weights"] == [] for r in per_rank), f"world {world}: {[r['load_weights'] for r in per_rank]}"


def test_a_fused_moe_folder_trains_as_hugging_face_loads_it(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    if world == 1:
        assert per_rank[0]["trained"] <= 1e-5, per_rank[0]["trained"]


def test_save_pretrained_writes_the_hub_layout(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    assert per_rank[0]["saved"] == {"loaded": [], "built": []}, f"world {world}: {per_rank[0]['saved']}"


def test_merged_lora_is_written_as_peft_merges_it(results: tuple[int, list[dict]]) -> None:
    world, per_rank = results
    if per_rank[0]["merged"] is None:
        pytest.skip("this peft has no LoRA on bare parameters (target_parameters): the fused experts' adapters")
    assert per_rank[0]["merged"] == [], f"world {world}: {per_rank[0]['merged']}"


def test_a_conversion_across_units_is_saved_in_the_model_layout(
    folders: tuple[str, list[str]], monkeypatch: Any, caplog: Any, tmp_path: Any
) -> None:
    """A conversion that joins two units' tensors cannot be reverted unit by unit: the model's own
    names are written (transformers loads them too), with a warning."""
    import transformers.conversion_mapping as mapping
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import Chunk, WeightConverter

    real = mapping.get_model_conversion_mapping
    joined = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]

    def joining_two_layers(model: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return [*real(model, *args, **kwargs), WeightConverter(
            source_patterns=["model.both.weight"], target_patterns=joined, operations=[Chunk(dim=0)],
        )]

    built = _build("mixtral")
    expected = {k: v.clone() for k, v in built.state_dict().items()}
    model = zeroinf.shard(built, zeroinf.Config(stage=3, persist_threshold_bytes=0))
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", joining_two_layers)
    with caplog.at_level("WARNING", logger="zeroinf.weights"):
        zeroinf.save_pretrained(model, tmp_path)
    zeroinf.engine_of(model).close()
    assert "spans two units" in caplog.text
    written = _stored(str(tmp_path))
    assert set(joined) <= set(written) and "model.both.weight" not in written
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", real)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert _differences(loaded, expected) == []


@pytest.mark.parametrize("arch", [pytest.param(a, marks=needs_model_type(a)) for a in ("gte", "nomic_bert", "dinov2")])
def test_an_encoder_in_the_hub_layout_loads_and_saves_as_hugging_face(arch: str, tmp_path: Any) -> None:
    """Embedding and vision encoders (`auto_class=AutoModel`), params on NVMe: gte and nomic-bert store
    each layer's q, k and v as one fused tensor (and gte its gate and up) that the model splits
    (Chunk); Dinov2's initialization draws with trunc_normal_, which cannot run on the placeholders
    of weights the files hold (the draws are skipped as transformers' own loader skips them). The
    sharded model equals transformers' load (parameters and buffers), and saving writes the folder
    back key for key and bitwise."""
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if arch == "dinov2":
        cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                              image_size=32, patch_size=8)
    else:
        cfg = tf.AutoConfig.for_model(arch, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=48, max_position_embeddings=32)
    torch.manual_seed(0)
    folder = str(tmp_path / "hub")
    tf.AutoModel.from_config(cfg).save_pretrained(folder)
    stored = _stored(folder)
    reference = tf.AutoModel.from_pretrained(folder, dtype=torch.float32)
    assert set(stored) != set(reference.state_dict()) or arch == "dinov2"  # the Hub layout is not the model's
    model = zeroinf.from_pretrained(folder, _cfg("nvme", str(tmp_path / "swap")), auto_class=tf.AutoModel)
    try:
        assert _differences(model.state_dict(), reference.state_dict()) == []
        assert _differences(dict(model.named_buffers()), dict(reference.named_buffers())) == []
        zeroinf.save_pretrained(model, tmp_path / "resaved")
        assert _differences(_stored(str(tmp_path / "resaved")), stored) == []
    finally:
        zeroinf.engine_of(model).close()


def _qwen3_vl_moe_folder(root: str) -> str:
    """A Qwen3-VL-MoE folder in the Hub's layout: its experts stored (experts, in, out), which the
    model holds transposed (transformers' Transpose(1, 2, check_dims=True) at load)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    text = dict(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, head_dim=8,
                rope_scaling=dict(rope_type="default", mrope_section=[1, 1, 2], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
                              vision_start_token_id=152)
    torch.manual_seed(0)
    path = os.path.join(root, "qwen3_vl_moe")
    tf.AutoModelForImageTextToText.from_config(cfg).save_pretrained(path, max_shard_size="20KB")
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, name))
            tensors = {k: v.mT.contiguous() if ".mlp.experts." in k else v for k, v in tensors.items()}
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
    return path


def _transposed_experts(rank: int, world: int, path: str, root: str) -> list[str]:
    """Parameters on NVMe against transformers' load, then `save_pretrained` against its own (which
    writes the experts as the model holds them: check_dims finds them already in shape)."""
    from transformers import AutoModelForImageTextToText as Auto

    reference = Auto.from_pretrained(path, dtype=torch.float32)
    model = zeroinf.from_pretrained(path, _cfg("nvme", os.path.join(root, f"swap-{world}-{rank}")), auto_class=Auto)
    out = os.path.join(root, f"resaved-{world}")
    try:
        diffs = _differences(model.state_dict(), reference.state_dict())
        zeroinf.save_pretrained(model, out)
    finally:
        zeroinf.engine_of(model).close()
    if rank == 0:
        reference.save_pretrained(os.path.join(root, f"by-hf-{world}"))
        diffs += [f"saved {k}" for k in _differences(_stored(out), _stored(os.path.join(root, f"by-hf-{world}")))]
    return diffs


def test_transposed_experts_load_and_save_as_hugging_face(tmp_path: Any) -> None:
    """Qwen3-VL-MoE's experts, stored transposed against the model, read by blocks (one expert's
    matrix) and transposed in memory, at world 1 and 2 (shards cut inside experts)."""
    path = _qwen3_vl_moe_folder(str(tmp_path))
    assert _transposed_experts(0, 1, path, str(tmp_path)) == []
    assert run_ranks(_transposed_experts, 2, path, str(tmp_path), timeout_s=300) == [[], []]


def test_rope_row_order_reads_either_name_of_transformers_permutation() -> None:
    """transformers 5.17 named PermuteForRope's permutation `_apply(tensor)` (reading `op.config`), later
    `_permute_for_rope(tensor, config)`: both give the same order (the installed one is the oracle)."""
    import transformers as tf
    from transformers.core_model_loading import PermuteForRope

    from zeroinf.weights.hf_conversion import _rope_row_order

    config = tf.LlamaConfig(hidden_size=32, num_attention_heads=4)
    op = PermuteForRope(permute_layer_names=["q_proj"])
    rows = torch.arange(32)
    if hasattr(op, "_permute_for_rope"):
        expected = op._permute_for_rope(rows, config).tolist()

        class Older:  # 5.17's interface over the installed permutation
            config: Any = None

            def _apply(self, tensor: torch.Tensor) -> torch.Tensor:
                return op._permute_for_rope(tensor, self.config)

        older: Any = Older()
    else:  # transformers 5.17 itself
        op.config = config
        expected, older = op._apply(rows).tolist(), op
    assert expected != list(range(32))
    assert _rope_row_order(older, 32, config) == expected
    if hasattr(op, "_permute_for_rope"):
        assert _rope_row_order(op, 32, config) == expected


@pytest.mark.parametrize("fused", [False, True], ids=["q-k-permuted", "qkv-chunked-then-permuted"])
def test_rope_permuted_rows_load_and_save_as_hugging_face(fused: bool, tmp_path: Any, monkeypatch: Any) -> None:
    """transformers' PermuteForRope (Mistral Large 4's and Kimi-K2.5's towers: rows stored for
    interleaved RoPE, held rotate-half) on a Llama's q and k, alone or after chunking a fused qkv:
    the folder transformers' save_pretrained writes under that conversion loads, params on NVMe,
    as the values it saved, and is written back key for key and bitwise."""
    import transformers as tf
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Chunk, PermuteForRope, WeightConverter

    real = mapping.get_model_conversion_mapping

    def added() -> list[Any]:  # fresh converters per call: loading keeps state in them
        if fused:
            return [WeightConverter(source_patterns="self_attn.wqkv.weight", target_patterns=[
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
                operations=[Chunk(dim=0), PermuteForRope(permute_layer_names=["q_proj", "k_proj"])])]
        # without names every row is permuted; transformers 5.17 needed the names
        names: Any = (lambda m: None) if hasattr(PermuteForRope, "_permute_for_rope") else (lambda m: [m])
        return [WeightConverter(source_patterns=f"self_attn.{m}.weight", target_patterns=f"self_attn.{m}.weight",
                                operations=[PermuteForRope(permute_layer_names=names(m))])
                for m in ("q_proj", "k_proj")]

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda m, *a, **k: [*real(m, *a, **k), *added()])
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    built = tf.LlamaForCausalLM(cfg)
    built.save_pretrained(tmp_path / "hub")
    stored = _stored(str(tmp_path / "hub"))
    q = "model.layers.0.self_attn.q_proj.weight"
    if fused:
        assert "model.layers.0.self_attn.wqkv.weight" in stored
    else:
        assert not torch.equal(stored[q], built.state_dict()[q])  # stored permuted
    # (transformers' own load of this folder is no reference here: after the other case's patched mapping
    # in the same process it loaded the fused case's q, k and v wrongly; alone it equals `built`)
    model = zeroinf.from_pretrained(tmp_path / "hub", _cfg("nvme", str(tmp_path / "swap")))
    try:
        assert _differences(model.state_dict(), built.state_dict()) == []  # the values transformers saved
        zeroinf.save_pretrained(model, tmp_path / "resaved")
        assert _differences(_stored(str(tmp_path / "resaved")), stored) == []
    finally:
        zeroinf.engine_of(model).close()


def test_a_conversion_that_is_not_a_range_is_refused(folders: tuple[str, list[str]], monkeypatch: Any) -> None:
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Chunk, Interleave, Transpose, WeightConverter

    _, paths = folders
    real = mapping.get_model_conversion_mapping

    def adding(operations: list[Any]) -> Any:
        def conversions(model: Any, *args: Any, **kwargs: Any) -> list[Any]:
            return [*real(model, *args, **kwargs), WeightConverter(
                source_patterns=["self_attn.q_proj.weight"], target_patterns=["self_attn.q_proj.weight"],
                operations=operations,
            )]
        return conversions

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", adding([Interleave(0)]))
    with pytest.raises(WeightsError, match=r"q_proj.weight.*Interleave"):
        zeroinf.from_pretrained(paths[0], zeroinf.Config(stage=3))
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", adding([Transpose(0, 1), Chunk(0)]))
    with pytest.raises(WeightsError, match=r"q_proj.weight.*Chunk"):  # a transposed tensor feeds another operation
        zeroinf.from_pretrained(paths[0], zeroinf.Config(stage=3))


def test_a_vlm_loads_without_naming_its_class(tmp_path: Any) -> None:
    """`zeroinf.from_pretrained` of a LLaVA folder (its Hub keys renamed into the model's), with no
    `auto_class` and the placement left to the planner (`offload="auto"`), as transformers'
    AutoModelForImageTextToText loads it: it built an AutoModelForCausalLM and stopped."""
    import transformers as tf

    text = tf.LlamaConfig(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128)
    vision = tf.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                 image_size=32, patch_size=8)
    torch.manual_seed(0)
    tf.LlavaForConditionalGeneration(tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=150)
                                     ).save_pretrained(tmp_path / "hub")
    cfg = zeroinf.Config(stage=3, offload=zeroinf.OffloadConfig(params="auto", optimizer="auto",
                                                                nvme_dir=str(tmp_path / "swap")))
    model = zeroinf.from_pretrained(tmp_path / "hub", cfg)
    try:
        reference = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "hub", dtype=torch.float32)
        assert type(model) is type(reference)
        assert _differences(model.state_dict(), reference.state_dict()) == []
    finally:
        zeroinf.engine_of(model).close()
