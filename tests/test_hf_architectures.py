"""Stage 3 on twenty-three more Hugging Face architectures, unchanged, against plain data parallelism.

Tiny configs (no downloads) of T5 (encoder-decoder, shared embeddings), BERT and DistilBERT (masked
LM, tied decoder), Mistral, Gemma (scaled, tied embeddings), Gemma 2 (sliding window, soft-capping),
Phi-3, GPT-NeoX, GPT-J, OPT (projected embeddings), BLOOM (ALiBi), Falcon, Mixtral, Qwen2-MoE (with
a shared expert) and DeepSeek-V3 (latent attention, a dense first layer) as mixtures of experts
where each rank routes its own tokens, Mamba (a state-space model), Whisper (audio features into an
encoder-decoder), ViT (images, a class token and position embeddings held by the root), and five
whose layers are not all alike: Jamba (Mamba and attention layers, experts every other layer), Qwen3-Next
(gated delta-net linear attention beside full attention), gpt-oss (attention sinks, sliding and full
layers, experts), Cohere 2 (parallel attention and MLP, sliding layers) and RWKV (recurrent). One
spawned group at world 2, parameters on NVMe, every unit sharded (`persist_threshold_bytes=0`),
untied embeddings and heads split from the root (`split_root_min_bytes=0`), 3 steps of AdamW on
each rank's half of the batch. The reference is plain data parallelism in the same group: on each
rank a plain copy trains the same half, its gradients all-reduced and averaged as DDP does, with
`torch.optim.AdamW(fused=True)`, whose arithmetic zeroinf's CPU step shares (the default foreach
kernel differs in the last bit, which Adam turns into ~5e-5 where gradients are near zero). Two
addends sum to the same float in either order, so the state after training is **bitwise** equal,
buffers included. A parameter no rank's tokens reached (an expert routed nothing) gets no gradient
and no step in either; one that some rank reached is reduced with zeros from the others (DDP with
`find_unused_parameters` would step the unreached ones too, with zero gradients). `benchmarks/hf_sweep.py`
runs every type of six Auto classes of the installed transformers the same way from generically
shrunk configs (by hand: minutes; docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks

VOCAB, STEPS, BATCH, LR = 96, 3, 8, 1e-3
ARCHS = [
    "t5", "bert", "distilbert", "mistral", "gemma", "gemma2", "phi3", "gpt_neox", "gptj", "opt", "bloom", "falcon",
    "mixtral", "qwen2_moe", "deepseek_v3", "mamba", "whisper", "vit", "jamba", "qwen3_next", "gpt_oss", "cohere2",
    "rwkv",
]
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None}


def build(arch: str) -> tuple[torch.nn.Module, str]:
    """The model and its kind of batch ("clm", "mlm", "seq2seq", "audio", "image")."""
    import transformers as tf

    tf.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB}
    decoder = {**small, "intermediate_size": 64, **NO_SPECIAL_TOKENS}
    if arch == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg), "seq2seq"
    if arch == "bert":
        cfg = tf.BertConfig(**small, intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(cfg), "mlm"
    if arch == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0,
                                  attention_dropout=0.0)
        return tf.DistilBertForMaskedLM(cfg), "mlm"
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**decoder, num_key_value_heads=2, pad_token_id=None)), "clm"
    if arch == "gemma":
        cfg = tf.GemmaConfig(**decoder, num_key_value_heads=1, head_dim=8, pad_token_id=None)
        return tf.GemmaForCausalLM(cfg), "clm"
    if arch == "phi3":
        cfg = tf.Phi3Config(**decoder, pad_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        return tf.Phi3ForCausalLM(cfg), "clm"
    if arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(**decoder, hidden_dropout=0.0, attention_dropout=0.0)
        return tf.GPTNeoXForCausalLM(cfg), "clm"
    if arch == "opt":
        cfg = tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, pad_token_id=1,
                           **NO_SPECIAL_TOKENS)
        return tf.OPTForCausalLM(cfg), "clm"
    if arch == "bloom":
        cfg = tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                             attention_dropout=0.0, **NO_SPECIAL_TOKENS)
        return tf.BloomForCausalLM(cfg), "clm"
    if arch == "falcon":
        cfg = tf.FalconConfig(**small, hidden_dropout=0.0, attention_dropout=0.0, **NO_SPECIAL_TOKENS)
        return tf.FalconForCausalLM(cfg), "clm"
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**decoder, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                               pad_token_id=None)
        return tf.MixtralForCausalLM(cfg), "clm"
    if arch == "gemma2":
        cfg = tf.Gemma2Config(**decoder, num_key_value_heads=2, head_dim=8, pad_token_id=None, sliding_window=4)
        return tf.Gemma2ForCausalLM(cfg), "clm"
    if arch == "gptj":
        cfg = tf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, **NO_SPECIAL_TOKENS)
        return tf.GPTJForCausalLM(cfg), "clm"
    if arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**decoder, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=None)
        return tf.Qwen2MoeForCausalLM(cfg), "clm"
    if arch == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**decoder, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                  v_head_dim=8, pad_token_id=None)
        return tf.DeepseekV3ForCausalLM(cfg), "clm"
    if arch == "mamba":
        cfg = tf.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                             conv_kernel=4, pad_token_id=None, **NO_SPECIAL_TOKENS)
        return tf.MambaForCausalLM(cfg), "clm"
    if arch == "jamba":
        cfg = tf.JambaConfig(**decoder, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                             attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                             pad_token_id=None)
        return tf.JambaForCausalLM(cfg), "clm"
    if arch == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**decoder, num_key_value_heads=2, head_dim=8, linear_num_value_heads=4,
                                 linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                 layer_types=["linear_attention", "full_attention"], pad_token_id=None)
        return tf.Qwen3NextForCausalLM(cfg), "clm"
    if arch == "gpt_oss":
        cfg = tf.GptOssConfig(**decoder, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=4, layer_types=["sliding_attention", "full_attention"], pad_token_id=None)
        return tf.GptOssForCausalLM(cfg), "clm"
    if arch == "cohere2":
        cfg = tf.Cohere2Config(**decoder, num_key_value_heads=2, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"], pad_token_id=None)
        return tf.Cohere2ForCausalLM(cfg), "clm"
    if arch == "rwkv":
        cfg = tf.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                            intermediate_size=64, context_length=32, **NO_SPECIAL_TOKENS)
        return tf.RwkvForCausalLM(cfg), "clm"
    if arch == "whisper":
        cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, dropout=0.0,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        return tf.WhisperForConditionalGeneration(cfg), "audio"
    if arch == "vit":
        cfg = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
        return tf.ViTForImageClassification(cfg), "image"
    raise KeyError(arch)


def batch(kind: str, step: int, rows: slice) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if kind == "image":
        images, labels = torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g)
        return {"pixel_values": images[rows], "labels": labels[rows]}
    if kind == "audio":
        features, labels = torch.randn(BATCH, 8, 16, generator=g), torch.randint(3, VOCAB, (BATCH, 6), generator=g)
        return {"input_features": features[rows], "labels": labels[rows]}
    ids = torch.randint(2, VOCAB, (BATCH, 12), generator=g)
    if kind == "seq2seq":
        return {"input_ids": ids[rows], "labels": torch.randint(2, VOCAB, (BATCH, 6), generator=g)[rows]}
    return {"input_ids": ids[rows], "labels": ids[rows]}


def _average_over_ranks(params: list[torch.nn.Parameter], world: int) -> None:
    """DDP's reduction by hand: the mean over ranks of each gradient some rank has."""
    import torch.distributed as dist

    some_rank = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(some_rank, op=dist.ReduceOp.MAX)
    for p, reached in zip(params, some_rank.tolist(), strict=True):
        if reached:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world


def _case(rank: int, world: int, arch: str, folder: str) -> float:
    model, kind = build(arch)
    plain = copy.deepcopy(model)
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, split_root_min_bytes=0,
        offload=zeroinf.OffloadConfig(params="nvme", nvme_dir=folder),
    )
    model = zeroinf.shard(model, cfg).train()
    opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
    plain_opt = torch.optim.AdamW(plain.train().parameters(), lr=LR, weight_decay=0.0, fused=True)
    per = BATCH // world
    for step in range(STEPS):
        mine = slice(rank * per, (rank + 1) * per)
        opt.backward(model(**batch(kind, step, mine)).loss)
        opt.step()
        opt.zero_grad()
        plain(**batch(kind, step, mine)).loss.backward()
        _average_over_ranks(list(plain.parameters()), world)
        plain_opt.step()
        plain_opt.zero_grad()
    state = model.state_dict()
    diff = max((state[k].double() - v.double()).abs().max().item() for k, v in plain.state_dict().items())
    opt.close()
    zeroinf.engine_of(model).close()
    return diff


def run(rank: int, world: int, root: str) -> dict[str, float]:
    out = {}
    for arch in ARCHS:
        folder = os.path.join(root, f"{arch}-rank{rank}")
        os.makedirs(folder, exist_ok=True)
        out[arch] = _case(rank, world, arch, folder)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-hf-archs-") as root:
        return run_ranks(run, 2, root, timeout_s=420)


@pytest.mark.parametrize("arch", ARCHS)
def test_stage_3_trains_bitwise_as_plain_data_parallelism(results: list[dict[str, Any]], arch: str) -> None:
    for rank, r in enumerate(results):
        assert r[arch] == 0.0, (rank, arch, r[arch])
