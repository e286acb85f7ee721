"""Every architecture of the installed transformers, by head, tiny, sharded against plain PyTorch.

    python benchmarks/hf_sweep.py --placement nvme --out sweep.json      # ~5 min on 2 cores
    python benchmarks/hf_sweep.py --only llama,jamba,gpt_oss --world 2
    python benchmarks/hf_sweep.py --head seq-cls                          # BERT-style fine-tuning heads

tests/test_hf_architectures.py checks twenty-three hand-written configurations in the suite; this sweep
asks the installed transformers for every model type its Auto class of `--head` knows (causal LM by
default; encoder-decoder LM, masked LM, sequence and token classification: labels drawn from the
tokens; image classification: 32x32 random images, convolutional stages shrunk), builds each from
its default config shrunk to a few thousand parameters (hidden 32, 2 layers, 4 heads, vocab 128,
every dropout and router jitter at 0: the shrinking is generic, so some types do not build or do
not run this way, and are reported as such, not as zeroinf's failures), and trains it 2 steps of
AdamW on random tokens three ways:

- plain PyTorch (`torch.optim.AdamW(fused=True)`), the reference;
- world 1: a copy sharded by `zeroinf.shard` at stage 3 (`--stage`) with every unit sharded
  (`persist_threshold_bytes=0`) and parameters (stage 3) and optimizer states on `--placement`, in this
  process: losses and weights must be **bitwise** the reference's (zeroinf's CPU step is the same
  fused kernel);
- world 2 (`--world 2`): the same in one spawned gloo group, each rank on half of each batch:
  losses (the mean of the ranks') within rtol 1e-5 and weights within 5e-5 of the reference (the
  parity suite's fp32 tolerance), since the gradients are summed in another order, or no further
  from it than twice plain data parallelism is: each rank also trains a plain copy on its half,
  averaging the gradients with `all_reduce` as DDP does. Adam turns a gradient that is rounding noise
  (a key bias the softmax cancels, a near-cancelling sum) into a step of +-lr whatever its size, and
  module buffers that track the data (I-BERT's activation ranges; BatchNorm's running statistics)
  are each rank's own, as under FSDP, and BatchNorm normalizes each rank's half of the batch (the
  losses move too): plain data parallelism moves as far, so none of it is zeroinf's.
  Two addends sum to the same float in either order, so zeroinf can also be, and is reported when
  it is, bitwise those data-parallel copies ("ddp-bitwise").

With `--init`, the sharded copies are built under `zeroinf.init(cfg)` (one unit at a time, each
rank keeping its shard) instead of copied from an eagerly built model: the gathered `state_dict`
after `zeroinf.shard`, buffers included, must then be bitwise the eager model's before training
starts (the init issue's "same seed, same model" across architectures), and training as above.

With `--dtype bf16`, zeroinf computes in bf16 with fp32 masters, and so does the reference by hand:
fused AdamW on the fp32 parameters, forward and backward in a copy cast with `.to(torch.bfloat16)`
(rotary `inv_freq` tables kept fp32, as zeroinf keeps them: precision.py [Note: which buffers take
the compute dtype]; what the model declares fp32 kept fp32, as a bf16 `from_pretrained` keeps it:
precision.py [Note: parameters the model keeps in fp32]), its gradients widened to fp32 (and at
world 2 averaged over the group), the masters copied into it after each step: bitwise at world 1,
and at world 2 bitwise its data-parallel copies ("ddp-bitwise"; the single-process run is ~1e-3 away
there, each rank rounding its own half's gradients to bf16).

With `--init --dtype bf16`, the reference is zeroinf's own eager path instead of plain PyTorch: the
eagerly built model sharded with bf16 compute (fp32 masters from the fp32 values it was built with),
against the model built under `zeroinf.init(cfg, exact_masters=True)`, world 1: state after `shard`,
losses and weights must be bitwise equal (the init issue's bf16 case); and the first loss must be
bitwise that of the eager model cast by hand with `.to(torch.bfloat16)`, rotary `inv_freq` tables
kept fp32 (precision.py [Note: which buffers take the compute dtype]).

With `--checkpointing`, activations are recomputed in backward: `hf` turns on Hugging Face's own
gradient checkpointing in both models (`gradient_checkpointing_enable()`, torch.utils.checkpoint
around each layer, which at stage 3 gathers the layer's parameters again inside the recompute);
`zeroinf` and `zeroinf-offload` set the sharded copy's `activation_checkpointing` (and
`offload_activations`), the reference training without: the results must not change.

With `--generate`, world 1 also compares `generate()` (greedy, 6 new tokens from 2 prompts, the KV
cache on) of a freshly built plain model and its sharded copy: the tokens must be equal. This is the
inference path (use_cache=True, each unit gathered once per token), which training does not walk.
At world 2 each rank generates from its own prompt for its own number of tokens (4 + 6 and 6 + 9),
so Hugging Face's `synced_gpus` (on for a sharded model) keeps the rank that finished stepping with
the other; the reference is the plain model generating the same with `synced_gpus=True` in the same
group ("plain-cannot" where that fails: Hugging Face's own limit for the type). A type whose ranks
fail ends the group (they may be out of step); the types after it run in a new one.

Prints one line per model type as it goes and writes a JSON report: per type its verdict ("bitwise"
at world 1, "bitwise+ddp-bitwise" with world 2 bitwise the plain data-parallel copies, "bitwise+within"
with world 2 within tolerance, "differs", "error" with zeroinf's traceback tail,
"not-built" with the plain model's error, "too-large"), the losses and the largest weight
difference; and a summary with the counts, the machine and the transformers version.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import io
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _bench import machine  # noqa: E402

from zeroinf.config import DTYPES  # noqa: E402

STEPS, ROWS, SEQ, VOCAB, LR = 2, 4, 12, 128, 1e-3
MAX_PARAMS = 3_000_000  # types whose shrunk config stays larger are skipped (encoder-decoders with fixed sizes)
SHRINK = dict(  # applied to every attribute the default config has, under any of these names
    hidden_size=32, n_embd=32, d_model=32, num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_key_value_heads=2, intermediate_size=64,
    ffn_dim=64, n_inner=64, d_ff=64, vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, head_dim=8,
    num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_routed_experts=4,
    shared_expert_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, decoder_start_token_id=0, rotary_dim=4, sliding_window=16,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
    decoder_ffn_dim=64, n_group=1, topk_group=1,
    # state-space layers (Mamba-2 in the hybrids): 4 heads of 16 = expand 2 x hidden 32
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, n_mamba_heads=4, mamba_headdim=16,
)
# Per type: what the names above do not reach (sizes under other names, ties between sizes)
TYPE_SHRINK: dict[str, dict[str, Any]] = {
    "mamba2": dict(head_dim=16, n_groups=1, state_size=8, chunk_size=8),
    "zamba2": dict(attention_head_dim=16, kv_channels=8, num_query_groups=4, chunk_size=8, attention_hidden_size=64,
                   adapter_rank=8, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "dots1": dict(n_shared_experts=1),
    "bit": dict(num_groups=8),
    **{name: dict(patch_size=4, num_hidden_layers=4) for name in ("convnext", "convnextv2")},  # its 4 stages: 8 to 1
    **{name: dict(patch_size=4, depths=[1, 1, 1], num_heads=[2, 2, 2]) for name in ("swin", "swinv2", "donut-swin")},
    **{t5: dict(decoder_start_token_id=0) for t5 in ("t5", "mt5", "umt5", "longt5", "switch_transformers")},
    "falcon_h1": dict(mamba_d_ssm=64),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    "zamba": dict(attention_hidden_size=64, attention_head_dim=16, mamba_dt_rank=4),
    "blt": dict(encoder_hash_byte_group_vocab=VOCAB),
    "inkling2_text": dict(unpadded_vocab_size=VOCAB, eos_token_id=2),
    "roc_bert": dict(shape_vocab_size=VOCAB, pronunciation_vocab_size=VOCAB, shape_embed_dim=16,
                     pronunciation_embed_dim=16),
    "reformer": dict(axial_pos_shape=[3, 4], axial_pos_embds_dim=[16, 16],  # 3 x 4 = SEQ
                     attn_layers=["local", "lsh"]),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         layer_types=["sliding_attention", "full_attention"], laurel_rank=8, altup_num_inputs=2,
                         activation_sparsity_pattern=[0.0, 0.0]),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "longcat_flash": dict(head_dim=4, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=32),
}
LATENT_ATTENTION = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4)
SETTINGS: dict[str, Any] = {  # set by main, passed to each rank
    "checkpointing": "none", "stage": 3, "generate": False, "head": "causal-lm", "dtype": "fp32",
}
NUM_LABELS = 3  # of the classification heads
# per head: transformers' mapping of model types to classes, and whether it generates (and takes use_cache)
HEADS = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", True),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", True),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", False),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", False),
    "token-cls": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", False),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", False),
}
IMAGE = 32  # pixels a side of the image-cls head's random images (3 channels)
SHRINK_VISION = dict(image_size=IMAGE, patch_size=8, num_channels=3, embed_dim=16, embedding_size=16, window_size=2)
# list attributes of the vision configs: a value per stage
PER_STAGE = {"hidden_sizes": 16, "embed_dims": 16, "depths": 1, "num_heads": 2, "num_attention_heads": 2}
RANDOM_IN_TRAINING = ("dropout", "pdrop", "jitter", "drop_path")  # set to 0: ranks would draw other numbers


def model_types() -> dict[str, str]:
    """{model type: class name} of the head in SETTINGS."""
    from transformers.models.auto import modeling_auto

    names = sorted(getattr(modeling_auto, HEADS[SETTINGS["head"]][0]).items())
    return {t: (c[0] if isinstance(c, (list, tuple)) else c) for t, c in names}


def tiny_config(model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    cfg = _shrunk(cls, cls(), model_type, top=True)
    cfg._attn_implementation = "eager"
    return cfg


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - a per-layer attribute read globally (heterogeneous configs) refuses
        return False


def _shrunk(cls: Any, default: Any, model_type: str, top: bool) -> Any:
    """`default` shrunk: the names above it has, its sub-configs (a composite model's text, vision or
    attention parts) likewise, and with `top` the head's settings."""
    from transformers import PretrainedConfig

    kwargs = {k: v for k, v in SHRINK.items() if _has(default, k)}
    if top and SETTINGS["head"].endswith("-cls"):  # the head's own dropout defaults to 0.1 where the config has none
        kwargs.update(num_labels=NUM_LABELS, classifier_dropout=0.0)
    if SETTINGS["head"] == "image-cls":  # convolutional stages: each stage's list shrunk, widths doubling
        kwargs.update({k: v for k, v in SHRINK_VISION.items() if _has(default, k)})
        for name, small in PER_STAGE.items():
            value = getattr(default, name, None) if _has(default, name) else None
            if isinstance(value, (list, tuple)) and value:
                kwargs[name] = [small * 2**i if name in ("hidden_sizes", "embed_dims") else small
                                for i in range(len(value))]
    if _has(default, "qk_rope_head_dim"):  # latent attention derives its head sizes from these
        kwargs.update(LATENT_ATTENTION)
        kwargs.pop("head_dim", None)
    kwargs.update(TYPE_SHRINK.get(model_type, {}))
    if model_type == "reformer":  # its LM head attends causally, its masked-LM head both ways
        kwargs["is_decoder"] = SETTINGS["head"] == "causal-lm"
    if top and not HEADS[SETTINGS["head"]][1] and _has(default, "use_cache"):  # a classifier builds no cache
        kwargs["use_cache"] = False
    for name, value in default.to_dict().items():
        if isinstance(value, float) and any(word in name for word in RANDOM_IN_TRAINING):
            kwargs[name] = 0.0
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig) and name not in kwargs:
            kwargs[name] = _shrunk(type(value), value, getattr(value, "model_type", ""), top=False)
    try:
        return cls(**kwargs)  # through the constructor: derived sizes follow
    except Exception:  # noqa: BLE001 - a config that refuses these: set what it has on the default
        cfg = default
        for k, v in kwargs.items():
            try:
                setattr(cfg, k, v)
            except Exception:  # noqa: BLE001, S112 - an attribute it computes: keep its own
                continue
        return cfg


class TooLarge(Exception):
    pass


def build(model_type: str, under: Any = None, exact_masters: bool = False) -> torch.nn.Module:
    """The tiny model, seeded; TooLarge (counted on the meta device first) above MAX_PARAMS. `under`:
    a zeroinf Config to build it under `zeroinf.init` (then sharded by it)."""
    import transformers

    import zeroinf

    cfg = tiny_config(model_type)
    cls = getattr(transformers, model_types()[model_type])
    wanted = getattr(cls, "config_class", None)
    if wanted is not None and not isinstance(cfg, wanted):  # a composite type: its text model, as the Auto
        cfg = cfg.get_text_config(decoder=SETTINGS["head"] == "causal-lm")  # class's from_config builds it
        cfg._attn_implementation = "eager"
    with torch.device("meta"):  # a size left unshrunk (a hash-embedding table) would not fit in memory
        numel = sum(p.numel() for p in cls(cfg).parameters())
    if numel > MAX_PARAMS:
        raise TooLarge(f"{numel} parameters")
    torch.manual_seed(0)
    if under is None:
        return _prepared(cls(cfg))
    with zeroinf.init(under, exact_masters=exact_masters):
        model = _prepared(cls(cfg))
    return zeroinf.shard(model, under)


def _prepared(model: torch.nn.Module) -> torch.nn.Module:
    """Hugging Face's gradient checkpointing where asked; X-MOD's language adapters told which to use."""
    if hasattr(model, "set_default_language"):
        model.set_default_language("en_XX")
    return _with_hf_checkpointing(model)


def _with_hf_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    if SETTINGS["checkpointing"] == "hf":
        model.gradient_checkpointing_enable()
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def inputs(ids: torch.Tensor) -> dict[str, Any]:
    """The forward's arguments for the head in SETTINGS: labels drawn from the tokens."""
    head = SETTINGS["head"]
    if head == "image-cls":  # each row's image drawn from its own tokens: the same whatever the row slice
        seeds = [int(row[:4].sum()) * 1009 + int(row[0]) for row in ids]
        pixels = torch.stack([torch.randn(3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(s)) for s in seeds])
        return {"pixel_values": pixels, "labels": ids[:, 0] % NUM_LABELS}
    labels = {"seq-cls": ids[:, 0] % NUM_LABELS, "token-cls": ids % NUM_LABELS, "seq2seq": ids.flip(1)}
    if head == "seq-cls":  # one end-of-sequence token per row, last (BART's family pools the hidden state there)
        ids = torch.where(ids == SHRINK["eos_token_id"], 3, ids)
        ids[:, -1] = SHRINK["eos_token_id"]
    kwargs = {"input_ids": ids, "labels": labels.get(head, ids)}
    if HEADS[head][1]:
        kwargs["use_cache"] = False
    return kwargs


def train(model: torch.nn.Module, step: Any, rows: slice = slice(None)) -> list[float]:
    """STEPS steps; `step(loss)` runs backward and the optimizer step."""
    model.train()
    torch.manual_seed(1234)
    losses = []
    dtype = next(model.parameters()).dtype  # images in the model's dtype, as a loop casts them (zeroinf does too)
    for s in range(STEPS):
        given = inputs(batch(s)[rows])
        cast = {k: v.to(dtype) for k, v in given.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        loss = model(**{**given, **cast}).loss
        step(loss)
        losses.append(loss.item())
    return losses


def train_reference(
    model: torch.nn.Module, dtype: str = "fp32", rows: slice = slice(None), data_parallel: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: fused AdamW on the model's own fp32 parameters, the masters. Below fp32, forward
    and backward run in a copy cast by hand (`cast_by_hand`), whose gradients are widened to fp32 and
    whose parameters take the masters' values after each step. With `data_parallel`, on this rank's
    rows, the gradients averaged over the group as DDP does. The losses, and the state of the model
    that ran (the cast copy's: masters rounded, its buffers)."""
    import torch.distributed as dist

    compute = model if dtype == "fp32" else cast_by_hand(model, DTYPES[dtype])
    masters, params = list(model.parameters()), list(compute.parameters())
    opt = torch.optim.AdamW(masters, lr=LR, fused=True)

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        if compute is not model:
            for c, m in zip(params, masters, strict=True):
                m.grad, c.grad = (None if c.grad is None else c.grad.float()), None
        if data_parallel:
            used = torch.tensor([float(p.grad is not None) for p in masters])
            dist.all_reduce(used, op=dist.ReduceOp.MAX)  # a parameter some rank used: every rank reduces it
            for p, u in zip(masters, used.tolist(), strict=True):
                if u:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        if compute is not model:
            with torch.no_grad():
                for c, m in zip(params, masters, strict=True):
                    c.copy_(m)

    losses = train(compute, step, rows)
    return losses, {k: v.clone() for k, v in compute.state_dict().items()}


def sharding(placement: str, folder: str, dtype: str = "fp32") -> Any:
    import zeroinf

    nvme_dir = folder if placement == "nvme" else None
    stage, mode = SETTINGS["stage"], SETTINGS["checkpointing"]
    params = placement if stage == 3 else "device"  # parameters leave the device at stage 3 only
    offload = zeroinf.OffloadConfig(params=params, optimizer=placement, nvme_dir=nvme_dir)
    return zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, offload=offload, collective_timeout_s=120, param_dtype=dtype,
        activation_checkpointing=mode.startswith("zeroinf"), offload_activations=mode == "zeroinf-offload",
    )


def train_sharded(
    model: torch.nn.Module | str, placement: str, folder: str, rows: slice = slice(None), dtype: str = "fp32"
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`model`, or the model type to build under `zeroinf.init` (with exact masters in bf16): the
    losses, the gathered state before training and after it."""
    import zeroinf

    cfg = sharding(placement, folder, dtype)
    if isinstance(model, str):
        model = build(model, under=cfg, exact_masters=dtype != "fp32")
    else:
        model = zeroinf.shard(model, cfg)
    built = {k: v.clone() for k, v in model.state_dict().items()}  # a gather at stage 3
    opt = zeroinf.AdamW(model, lr=LR)

    def step(loss: torch.Tensor) -> None:
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    try:
        losses = train(model, step, rows)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
        zeroinf.engine_of(model).close()
    return losses, built, weights


def cast_by_hand(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` cast with `.to(dtype)`, rotary tables kept as built (precision.py [Note:
    which buffers take the compute dtype]), and the parameters and buffers the model declares fp32
    kept in fp32, as `from_pretrained(dtype=...)` keeps them (precision.py [Note: parameters the model
    keeps in fp32])."""
    import zeroinf
    from zeroinf.config import DTYPES
    from zeroinf.precision import fp32_names, keeps_its_precision

    keep = fp32_names(model, zeroinf.Config(param_dtype={v: k for k, v in DTYPES.items()}[dtype]))
    cast = copy.deepcopy(model)
    kept = {(n, b): t for n, m in cast.named_modules() for b, t in m._buffers.items()
            if t is not None and (keeps_its_precision(m, b) or (keep is not None and t.is_floating_point()
                                                                and keep(f"{n}.{b}" if n else b)))}
    cast = cast.to(dtype)
    for (n, b), t in kept.items():
        cast.get_submodule(n)._buffers[b] = t.float() if keep is not None and keep(f"{n}.{b}" if n else b) else t
    if keep is not None:
        with torch.no_grad():
            for (name, c), m in zip(cast.named_parameters(), model.parameters(), strict=True):
                if keep(name):
                    c.data = m.detach().float().clone()
    return cast


def first_loss_cast_by_hand(model: torch.nn.Module, dtype: torch.dtype) -> float:
    """The first training loss of `cast_by_hand(model, dtype)`."""
    return train(cast_by_hand(model, dtype), lambda loss: None)[0]


def generation_prompt(rank: int, world: int) -> tuple[torch.Tensor, int]:
    """The prompt and the number of new tokens of `rank` (world 2: other lengths on each rank)."""
    if world == 1:
        return batch(0)[:2, :6], 6
    return batch(0)[rank : rank + 1, : 4 + 2 * rank], 6 + 3 * rank


def compare_generation(model_type: str, placement: str, folder: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Greedy tokens of the plain model, then of its sharded copy (in a group: both with
    `synced_gpus=True`): {"verdict": "equal" | "differs" | "plain-cannot", ...}. The sharded copy's
    errors are raised."""
    import zeroinf

    prompt, new = generation_prompt(rank, world)
    kwargs = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    if world > 1:
        kwargs["synced_gpus"] = True
    model = build(model_type).eval()
    twin = copy.deepcopy(model)
    try:
        with torch.no_grad():
            expected = model.generate(prompt, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Hugging Face's generation fails for this type as is
        return {"verdict": "plain-cannot", "error": f"{type(exc).__name__}: {exc}"[:200]}
    sharded = zeroinf.shard(twin, sharding(placement, folder)).eval()
    try:
        with torch.no_grad():
            got = sharded.generate(prompt, **kwargs)
    finally:
        zeroinf.engine_of(sharded).close()
    equal = torch.equal(got, expected)
    return {"verdict": "equal" if equal else "differs", "plain": expected.tolist(), "ours": got.tolist()}


def weight_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise KeyError(f"the sharded model's state_dict lacks {missing[:3]}")
    return max(
        ((ours[k].float() - v.float()).abs().max().item()
         for k, v in ref.items() if v.is_floating_point() and v.numel()),
        default=0.0,
    )


def _packed(result: dict[str, Any]) -> bytes:
    """Tensors as bytes: a queue would pass them as shared memory, gone once this rank has exited."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _plain_cannot(result: dict[str, Any]) -> bool:
    """The plain model's synced generation failed on this rank: its group may be out of step."""
    return result.get("generate", {}).get("verdict") == "plain-cannot"


def _rank_main(
    rank: int, world: int, store: str, types: list[str], placement: str, root: str, under_init: bool,
    settings: dict[str, Any], results: Any,
) -> None:
    import torch.distributed as dist

    SETTINGS.update(settings)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    per = ROWS // world
    for model_type in types:
        try:
            folder = os.path.join(root, f"{model_type}-w{world}")
            os.makedirs(folder, exist_ok=True)
            model = model_type if under_init else build(model_type)
            rows = slice(rank * per, (rank + 1) * per)
            losses, built, weights = train_sharded(model, placement, folder, rows, dtype=SETTINGS["dtype"])
            ddp_losses, ddp_weights = train_reference(build(model_type), SETTINGS["dtype"], rows, data_parallel=True)
            mine = {"built": built, "weights": weights, "ddp_weights": ddp_weights} if rank == 0 else {}
            generated = {}
            if SETTINGS["generate"]:
                generated["generate"] = compare_generation(model_type, placement, folder + "-generate", rank, world)
            results.put((rank, model_type, _packed({"losses": losses, "ddp_losses": ddp_losses, **mine, **generated})))
            if _plain_cannot(generated):
                break  # the ranks may be out of step: the parent goes on in a new group
        except Exception:  # noqa: BLE001 - reported by the parent, which goes on in a new group
            results.put((rank, model_type, {"error": traceback.format_exc()[-1500:]}))
            break
    dist.destroy_process_group()


def run_world(
    types: list[str], world: int, placement: str, root: str, under_init: bool, timeout_s: float
) -> dict[str, list[dict]]:
    """Every type of `types` in one spawned group of `world` ranks: {type: [rank 0's result, ...]}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(root, "store")
    procs = [
        ctx.Process(
            target=_rank_main, daemon=True,
            args=(r, world, store, types, placement, root, under_init, dict(SETTINGS), results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[str, list[Any]] = {t: [None] * world for t in types}  # None: not reported
    deadline, expected = time.monotonic() + timeout_s, len(types) * world
    received = 0
    try:
        while received < expected:
            try:
                rank, model_type, payload = results.get(timeout=1.0)
            except queue.Empty:
                if (time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs)
                        or all(p.exitcode is not None for p in procs)):  # the ranks stopped after a failure
                    break  # what has not come stays None
                continue
            got[model_type][rank] = torch.load(io.BytesIO(payload)) if isinstance(payload, bytes) else payload
            received += 1
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def run_worlds(
    types: list[str], world: int, placement: str, root: str, under_init: bool, timeout_s: float
) -> dict[str, list[dict]]:
    """`run_world` until every type has its results: a type some rank failed (or never reported)
    ends its group, and the types after it go on in a new one."""
    out: dict[str, list[dict]] = {}
    pending = list(types)
    while pending:
        got = run_world(pending, world, placement, root, under_init, timeout_s)
        for i, model_type in enumerate(pending):
            per_rank = got[model_type]
            ended = any(p is None or "error" in p or _plain_cannot(p) for p in per_rank)
            out[model_type] = [p if p is not None else {"error": f"rank {r} gave no result"}
                               for r, p in enumerate(per_rank)]
            if ended:
                pending = pending[i + 1 :]
                break
        else:
            pending = []
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placement", choices=("device", "host", "nvme"), default="nvme",
                        help="where parameters and optimizer states live (default nvme)")
    parser.add_argument("--world", type=int, choices=(1, 2), default=2, help="2: also a spawned world-2 group")
    parser.add_argument("--head", choices=tuple(HEADS), default="causal-lm",
                        help="which Auto class: causal LM (default), encoder-decoder LM, masked LM, sequence or "
                        "token classification (labels drawn from the tokens), image classification (random images)")
    parser.add_argument("--only", default="", help="comma-separated model types (default: every type of --head)")
    parser.add_argument("--out", default=None, help="the JSON report (default: printed only)")
    parser.add_argument("--init", action="store_true",
                        help="build the sharded copies under zeroinf.init; their state must be the eager model's")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: compute in bf16 with fp32 masters, against plain PyTorch doing the same by hand "
                        "(with --init, world 1: zeroinf.init with exact masters against zeroinf's eager path)")
    parser.add_argument("--generate", action="store_true",
                        help="also compare greedy generate() of the plain model and its sharded copy")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3,
                        help="ZeRO stage (below 3 the parameters stay on the device, the optimizer on --placement)")
    parser.add_argument("--checkpointing", choices=("none", "hf", "zeroinf", "zeroinf-offload"), default="none",
                        help="recompute activations in backward: Hugging Face's own, or zeroinf's (and offloaded)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit of the world-2 group")
    args = parser.parse_args(argv)
    if args.dtype != "fp32" and args.init and args.world != 1:
        parser.error("--dtype bf16 --init compares zeroinf.init with zeroinf's eager path at world 1: give --world 1")
    if args.init and args.stage != 3:
        parser.error("--init builds each rank's stage-3 shards: give --stage 3")
    if args.generate and not HEADS[args.head][1]:
        parser.error(f"--generate: a {args.head} model does not generate; give --head causal-lm or seq2seq")
    import transformers

    SETTINGS.update(checkpointing=args.checkpointing, stage=args.stage, generate=args.generate, head=args.head,
                    dtype=args.dtype)
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    known = model_types()
    types = [t for t in args.only.split(",") if t] or list(known)
    unknown = sorted(set(types) - set(known))
    if unknown:
        parser.error(f"not {args.head} model types of transformers {transformers.__version__}: {', '.join(unknown)}")
    report: dict[str, dict[str, Any]] = {}
    # per type: the reference's losses, its weights after training, and as built
    plain: dict[str, tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    with tempfile.TemporaryDirectory(prefix="zeroinf-hf-sweep-") as root:
        for model_type in types:
            entry = report[model_type] = {"class": known[model_type]}
            try:
                model = build(model_type)
                entry["params"] = sum(p.numel() for p in model.parameters())
                twin = copy.deepcopy(model)
                reference_dtype = "fp32" if args.init else args.dtype  # bf16 with --init: zeroinf's eager path
                held = model if reference_dtype == "fp32" else cast_by_hand(model, DTYPES[reference_dtype])
                as_built = {k: v.clone() for k, v in held.state_dict().items()}
                losses, trained = train_reference(model, reference_dtype)
            except TooLarge as exc:
                entry.update(verdict="too-large", error=str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - the shrunk config does not build or run as plain PyTorch
                entry.update(verdict="not-built", error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            plain[model_type] = (losses, trained, as_built)
            entry["plain_losses"] = losses
            try:
                folder = os.path.join(root, f"{model_type}-w1")
                if args.dtype != "fp32" and args.init:  # the reference: zeroinf's eager path in that dtype
                    entry["cast_by_hand_loss"] = first_loss_cast_by_hand(twin, DTYPES[args.dtype])
                    losses, as_built, eager_weights = train_sharded(twin, args.placement, folder, dtype=args.dtype)
                    plain[model_type] = (losses, eager_weights, as_built)
                    entry["eager_losses"] = losses
                    folder += "-init"
                subject = model_type if args.init else twin
                ours, built, weights = train_sharded(subject, args.placement, folder, dtype=args.dtype)
                built_diff = weight_diff(built, plain[model_type][2])
                diff = weight_diff(weights, plain[model_type][1])
            except Exception:  # noqa: BLE001 - zeroinf's failure: reported with its traceback
                entry.update(verdict="error", error=traceback.format_exc()[-1500:])
                continue
            bitwise = ours == losses and diff == 0.0 and built_diff == 0.0
            bitwise = bitwise and entry.get("cast_by_hand_loss", losses[0]) == losses[0]
            entry.update(world1_losses=ours, world1_built_diff=built_diff, world1_weight_diff=diff,
                         verdict="bitwise" if bitwise else "differs")
            print(f"{model_type:28} world 1: {entry['verdict']:8} (weights {diff:.2e})", flush=True)
            if args.generate:
                try:
                    entry["generate"] = compare_generation(model_type, args.placement, folder + "-generate")
                except Exception:  # noqa: BLE001 - zeroinf's failure: reported with its traceback
                    entry["generate"] = {"verdict": "error", "error": traceback.format_exc()[-1500:]}
                if entry["generate"]["verdict"] in ("differs", "error"):
                    entry["verdict"] = entry["generate"]["verdict"]
                print(f"{model_type:28} generate: {entry['generate']['verdict']}", flush=True)
        if args.world == 2:
            trained = [t for t in types if report[t].get("verdict") in ("bitwise", "differs")]
            by_type = run_worlds(trained, 2, args.placement, root, args.init, args.timeout_s)
            for model_type, per_rank in by_type.items():
                entry = report[model_type]
                errors = [p["error"] for p in per_rank if "error" in p]
                if errors:
                    entry.update(verdict="error", error=errors[0])
                    print(f"{model_type:28} world 2: error", flush=True)
                    continue
                ref_losses, ref_weights, ref_built = plain[model_type]
                mean = [sum(p["losses"][s] for p in per_rank) / len(per_rank) for s in range(STEPS)]
                diff = weight_diff(per_rank[0]["weights"], ref_weights)
                built_diff = weight_diff(per_rank[0]["built"], ref_built)  # as built: bitwise at any world
                # plain data parallel's own distance from the single process, in losses and weights
                ddp_mean = [sum(p["ddp_losses"][s] for p in per_rank) / len(per_rank) for s in range(STEPS)]
                ddp_diff = weight_diff(per_rank[0]["ddp_weights"], ref_weights)
                close = all(abs(a - b) <= max(1e-5 * abs(b), 2 * abs(d - b))
                            for a, d, b in zip(mean, ddp_mean, ref_losses, strict=True))
                close = close and diff <= max(5e-5, 2 * ddp_diff) and built_diff == 0.0
                vs_ddp = weight_diff(per_rank[0]["weights"], per_rank[0]["ddp_weights"])
                as_ddp = vs_ddp == 0.0 and all(p["losses"] == p["ddp_losses"] for p in per_rank)
                close = close or (as_ddp and built_diff == 0.0)  # bitwise DDP: nothing of zeroinf's
                entry.update(world2_losses=mean, world2_built_diff=built_diff, world2_weight_diff=diff,
                             world2_ddp_weight_diff=ddp_diff, world2_vs_ddp_diff=vs_ddp)
                if "generate" in per_rank[0]:
                    verdicts = {p["generate"]["verdict"] for p in per_rank}
                    verdict = next(v for v in ("differs", "plain-cannot", "equal") if v in verdicts)
                    entry["generate_world2"] = {"verdict": verdict, "per_rank": [p["generate"] for p in per_rank]}
                    close = close and verdict != "differs"
                    print(f"{model_type:28} generate, world 2: {verdict}", flush=True)
                if not close:
                    entry["verdict"] = "differs"
                elif entry["verdict"] == "bitwise":
                    entry["verdict"] = "bitwise+ddp-bitwise" if as_ddp else "bitwise+within"
                world2 = ("ddp-bitwise" if as_ddp else "within") if close else "differs"
                print(f"{model_type:28} world 2: {world2:11} (weights {diff:.2e}, plain data parallel {ddp_diff:.2e},"
                      f" against it {vs_ddp:.2e})", flush=True)
    counts: dict[str, int] = {}
    for entry in report.values():
        counts[entry["verdict"]] = counts.get(entry["verdict"], 0) + 1
        for name in ("generate", "generate_world2"):
            if name in entry:
                key = f"{name} {entry[name]['verdict']}"
                counts[key] = counts.get(key, 0) + 1
    summary = {
        "head": args.head, "placement": args.placement, "world": args.world, "init": args.init, "dtype": args.dtype,
        "checkpointing": args.checkpointing, "stage": args.stage, "counts": counts,
        "transformers": transformers.__version__,
        "torch": torch.__version__, "machine": machine(),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "types": report}, f, indent=1)
    return 1 if counts.get("error", 0) or counts.get("differs", 0) else 0


if __name__ == "__main__":
    raise SystemExit(main())
