"""The planner's meta-tensor pass: fused attention as on the real device, and no torch._dynamo import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from zeroinf.planner.model_facts import from_preset


def test_attention_saves_what_the_fused_kernel_saves() -> None:
    # The math kernel (what meta tensors would pick) saves the seq x seq attention matrix: the saved
    # bytes of a block would grow 4x when the sequence doubles. The CPU flash kernel's grow 2x.
    facts = from_preset("tiny", seq_len=256)
    short = facts.pass_facts(1, 128, "fp32", torch.device("cpu"))
    long = facts.pass_facts(1, 256, "fp32", torch.device("cpu"))
    assert short is not None and long is not None
    assert long.unit_saved_bytes[0] == 2 * short.unit_saved_bytes[0]


def test_the_pass_leaves_torch_dynamo_unimported_and_working() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        from zeroinf.planner.model_facts import from_preset
        assert from_preset("tiny").pass_facts(2, 64, "bf16", torch.device("cpu")) is not None
        assert not [m for m in sys.modules if m.startswith("torch._dynamo")], "the pass imported dynamo"
        import torch._dynamo
        assert torch._dynamo.disable.__module__.startswith("torch._dynamo")
        emb = torch.nn.functional.embedding(torch.zeros(2, dtype=torch.long, device="meta"),
                                            torch.empty(3, 4, device="meta"))
        assert emb.shape == (2, 4)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _saved_config(tmp_path: Any, name: str) -> str:
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=96, num_key_value_heads=2, num_local_experts=4)
    else:  # DeepSeek-V3: multi-head latent attention, values of another head size than queries and keys
        config = tf.DeepseekV3Config(
            **common, intermediate_size=96, moe_intermediate_size=16, num_key_value_heads=4, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        )
    path = str(tmp_path / name)
    config.save_pretrained(path)
    return path


def test_plan_of_an_moe_folder_in_a_fresh_process(tmp_path: Any) -> None:
    """`zeroinf plan --hf` of a Mixtral stopped in a fresh process: its model module, imported lazily
    inside the meta build, imports what the dynamo stand-in cannot serve (torch._dynamo's submodules;
    torch.distributed.tensor, re-entered half-done). The class is imported before the build now."""
    pytest.importorskip("transformers")
    path = _saved_config(tmp_path, "mixtral")
    out = subprocess.run([sys.executable, "-m", "zeroinf", "plan", "--hf", path, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert plan["param_count"] > 0 and plan["best"], plan["summary"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_values_of_another_head_size_take_the_kernel_that_accepts_them(tmp_path: Any, device: str) -> None:
    """DeepSeek-V3's values have another head size than its queries: flash kernels refuse that, and the
    pass took the flash kernel's output shape (the query's head size) into o_proj's matmul and stopped.
    Planned for the CPU, and for a GPU from this machine, its parameters are counted as transformers'."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeroinf.planner.model_facts import from_hf

    path = _saved_config(tmp_path, "deepseek_v3")
    facts = from_hf(path)
    assert facts.pass_facts(1, 32, "bf16", torch.device(device)) is not None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    expected = sum(p.numel() for p in model.parameters())
    assert facts.param_count == expected


SWEEP = dict(  # one set of small sizes that every config below accepts
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=96, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)


@pytest.mark.parametrize("model_type", ["minimax", "falcon_h1", "jetmoe"])
def test_configs_that_stopped_the_plan(tmp_path: Any, model_type: str) -> None:
    """MiniMax: its persistent fp32 decay buffers stayed fp32 in the bf16 pass (the engine casts
    persistent floating buffers to the compute dtype) and met bf16 activations in a matmul.
    Falcon-H1: its config.json holds {"__float__": "Infinity"}, which transformers decodes when it
    reads a config and the planner did not. JetMoE: its expert routing reads values (`.tolist()`),
    which meta tensors do not have: the plan is made without measured activations and says why."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from zeroinf.planner.api import plan
    from zeroinf.planner.model_facts import from_hf

    path = tmp_path / model_type
    CONFIG_MAPPING[model_type](**SWEEP).save_pretrained(path)
    facts = from_hf(path)
    measured = facts.pass_facts(1, 32, "bf16", torch.device("cpu"))
    if model_type == "jetmoe":
        assert measured is None and facts.pass_error is not None and "meta" in facts.pass_error
        notes = plan(facts, world_size=1, seq_len=32, nvme_dir=str(tmp_path)).notes
        assert any("activations not measured: the forward does not run on meta tensors" in n for n in notes), notes
    else:
        assert measured is not None and measured.saved_bytes > 0


def test_a_vlm_is_planned_as_its_image_text_to_text_model(tmp_path: Any) -> None:
    """LLaVA has no causal-LM class in transformers (nor Qwen-VL, Gemma 3): the plan built it with
    AutoModelForCausalLM and stopped. It is built as transformers' image-text-to-text model now: all
    its parameters (vision tower and projector included) counted, a text pass measured."""
    pytest.importorskip("transformers")
    import transformers

    from zeroinf.planner.model_facts import from_hf

    text = transformers.LlamaConfig(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128)
    vision = transformers.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=48, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=150)
    config.save_pretrained(tmp_path)
    facts = from_hf(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    assert facts.param_count == sum(p.numel() for p in model.parameters())
    assert facts.pass_facts(1, 32, "bf16", torch.device("cpu")) is not None
