"""Tiny Hugging Face models (built from configs, no downloads) trained plainly and through zeroinf.

The same oracle as tests/_parity.py: the reference sees the whole global batch in one process with
`torch.optim.AdamW`; for bf16 it keeps fp32 masters and runs forward/backward in a bf16 copy
(`.to(bfloat16)`), whose floating buffers (Llama's rotary `inv_freq`) then take the dtype zeroinf
gave them: whether zeroinf casts buffers is its choice, not what this oracle tests (a bf16 `inv_freq`
alone moves bf16 Llama weights by ~1e-2 in 8 steps). zeroinf trains on each rank's slice of the
same global batches.

A case may also run greedy `.generate()` under no_grad in the middle of training (after
`generate_after` steps, and once before the first step): each rank generates from its own prompts and
compares with a plain copy of the model loaded with the gathered weights, then training goes on.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tests._parity import LR

VOCAB, SEQ, GLOBAL_BATCH = 128, 16, 8
BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1
PROMPT_LEN, NEW_TOKENS, PROMPTS_PER_RANK = 5, 8, 2


def has_model_type(model_type: str) -> bool:
    """Whether the installed transformers knows this model type (gte and Sarvam-MoE came after 5.17,
    the version on the lent H200's image)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING


def peft_lora_on_parameters() -> bool:
    """Whether the installed peft puts LoRA on bare parameters (`LoraConfig.target_parameters`: fused
    experts, routers), which peft 0.13, the declared floor, does not."""
    import dataclasses

    import peft

    return "target_parameters" in {f.name for f in dataclasses.fields(peft.LoraConfig)}


def needs_model_type(model_type: str) -> Any:
    """A mark skipping a case whose model type the installed transformers lacks, naming it."""
    import pytest

    return pytest.mark.skipif(not has_model_type(model_type), reason=f"this transformers has no {model_type!r}")


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # "gpt2", "llama", "llama-tied"
    stage: int = 3
    dtype: str = "fp32"
    steps: int = 8
    generate_after: int | None = None  # steps before the mid-training generation (None: no generation)
    reentrant_checkpointing: bool = False  # Hugging Face's gradient checkpointing with use_reentrant=True


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
            attn_implementation="eager",
        )
        return GPT2LMHeadModel(cfg)
    if arch in ("llama", "llama-tied"):
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=arch == "llama-tied",
            attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(cfg)
    raise ValueError(arch)


def global_batch(step: int, seed: int = 4321) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def prompts(rank: int) -> torch.Tensor:
    """Different prompts on every rank (generation must not need identical inputs)."""
    g = torch.Generator().manual_seed(777 + rank)
    return torch.randint(0, VOCAB, (PROMPTS_PER_RANK, PROMPT_LEN), generator=g)


def greedy(model: torch.nn.Module, ids: torch.Tensor, synced: bool | None = None) -> torch.Tensor:
    """Greedy decoding; `synced=None` leaves `synced_gpus` to `generate` (zeroinf models default it)."""
    kwargs = {} if synced is None else {"synced_gpus": synced}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=0, **kwargs,
        )


def train_causal_lm(
    model: torch.nn.Module, opt: Any, rows: Callable[[int], torch.Tensor], steps: int, world: int
) -> list[float]:
    """`steps` steps of a causal LM under `opt` (zeroinf.AdamW) on this rank's `rows(step)` (inputs
    and labels); returns each step's loss averaged over the ranks."""
    import torch.distributed as dist

    losses = []
    for step in range(steps):
        x = rows(step)
        loss = model(input_ids=x, labels=x).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def rank_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    return batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]


def _checkpointing(model: torch.nn.Module, case: Case) -> None:
    if case.reentrant_checkpointing:  # a backward per decoder layer, run inside the outer backward
        kwargs = {"use_reentrant": True}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name is deprecated
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train_reference(
    case: Case, buffer_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`buffer_dtypes`: the dtypes zeroinf gave the floating buffers (default: `.to(bfloat16)` casts all)."""
    master = build(case.arch)
    master.train()
    _checkpointing(master, case)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    compute = copy.deepcopy(master).to(torch.bfloat16) if case.dtype == "bf16" else master
    if compute is not master:
        for name, dtype in buffer_dtypes:
            owner, _, attr = name.rpartition(".")
            module = compute.get_submodule(owner)
            module._buffers[attr] = master.get_buffer(name).to(dtype)
    losses = []
    for step in range(case.steps):
        x = global_batch(step)
        if compute is not master:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                    c.copy_(m)
        loss = compute(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        if compute is not master:
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                m.grad, c.grad = c.grad.float(), None
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().float().clone() for n, p in master.named_parameters()}


@contextlib.contextmanager
def _live_blocks_probe(engine: Any) -> Iterator[list[int]]:
    """Record, as each sharded unit's forward starts, how many sharded units are gathered or gathering."""
    from zeroinf.partition.unit import ParamState

    seen: list[int] = []

    def probe(*_: Any) -> None:  # runs after zeroinf's (prepended) pre-hook has gathered the unit
        seen.append(sum(not u.resident and u.state is not ParamState.SHARDED for u in engine.units))

    handles = [
        spec.module.register_forward_pre_hook(probe)
        for spec, unit in zip(engine.specs, engine.units, strict=True)
        if not unit.resident
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _generate_and_compare(model: torch.nn.Module, case: Case, rank: int, world: int) -> dict[str, Any]:
    """Greedy generation on the sharded model vs a plain copy with the gathered weights (this rank)."""
    import zeroinf
    from zeroinf.engine import engine_of
    from zeroinf.partition.unit import ParamState

    engine = engine_of(model)
    sched = engine.scheduler
    assert sched is not None
    full = model.state_dict()  # a collective: every rank gathers
    plain = build(case.arch)
    plain.load_state_dict(full)
    plain.eval()
    ids = prompts(rank)
    model.eval()
    # Sharded units that must be gathered for this generation: every block once per decoding step,
    # plus resident units still sharded (the root starts sharded until the first pass gathers it).
    expected = sum(not u.resident for u in engine.units) * NEW_TOKENS + sum(
        u.resident and u.state is ParamState.SHARDED for u in engine.units
    )
    gathers_before = engine.counter.total.get("all_gather", 0)
    departures_before = zeroinf.memory_report(model)["trace_departures"]
    plan_before = sched.forward_plan
    with _live_blocks_probe(engine) as live:
        ours = greedy(model, ids)  # no synced_gpus: a sharded model makes generate default it at world > 1
    gathers = engine.counter.total.get("all_gather", 0) - gathers_before
    with torch.no_grad():
        logits = model(input_ids=ours).logits
    theirs = greedy(plain, ids, synced=False)
    with torch.no_grad():
        plain_logits = plain(input_ids=ours).logits
    model.train()
    return {
        "ours": ours, "theirs": theirs,
        "logit_diff": (logits - plain_logits).abs().max().item(),
        # every decoding step is one forward pass that gathers every block once (on demand or prefetched)
        "gathers": gathers, "expected_gathers": expected,
        # the first no-grad pass records the inference trace (one block live as each starts); the
        # next ones prefetch the following block along it (two live)
        "live_blocks": live, "peak_live_blocks": max(live),
        "inference_trace_state": sched.inference_trace.state.value,
        "inference_planned": sched.inference_plan is not None,
        "trace_state": sched.forward_trace.state.value,
        "plan_kept": sched.forward_plan is plan_before,
        "departures_delta": zeroinf.memory_report(model)["trace_departures"] - departures_before,
        # on-demand fetches are released right after use: only resident units stay unsharded
        "still_unsharded": [
            u.name for u in engine.units if not u.resident and u.state is not ParamState.SHARDED
        ],
    }


def train_zeroinf(case: Case, rank: int, world: int) -> dict[str, Any]:
    import zeroinf
    from zeroinf.engine import engine_of

    model = build(case.arch)
    _checkpointing(model, case)
    cls, keys = type(model), list(model.state_dict().keys())
    cfg = zeroinf.Config(  # the embeddings and head split from the root (they are smaller than a block here)
        stage=case.stage, param_dtype=case.dtype, persist_threshold_bytes=0, split_root_min_bytes=0
    )
    model = zeroinf.shard(model, cfg)
    engine = engine_of(model)
    opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    out: dict[str, Any] = {
        "class_kept": type(model) is cls,
        "units": [u.name for u in engine.units],
        "root_params": [n for u in engine.units if u.name == "<root>" for n in u.param_names],
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "generations": [],
        "collectives": [],
        "departures": [],
        "trace_states": [],
        "train_peak_live_blocks": [],
    }
    if case.generate_after is not None:
        out["generations"].append(_generate_and_compare(model, case, rank, world))  # before any training
    per_rank = GLOBAL_BATCH // world
    model.train()
    losses = []
    for step in range(case.steps):
        if step == case.generate_after:
            out["generations"].append(_generate_and_compare(model, case, rank, world))
        x = global_batch(step)[rank * per_rank : (rank + 1) * per_rank]
        before = dict(engine.counter.total)
        if case.stage == 3:
            with _live_blocks_probe(engine) as live:
                loss = model(input_ids=x, labels=x).loss
            out["train_peak_live_blocks"].append(max(live))
        else:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
            total /= world
        losses.append(total.item())
        report = zeroinf.memory_report(model)
        # this training step's own collectives (the last step's window also holds a generation's)
        after = engine.counter.total
        out["collectives"].append({k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)})
        out["departures"].append(report.get("trace_departures"))
        if engine.scheduler is not None:
            out["trace_states"].append(engine.scheduler.forward_trace.state.value)
    out["buffer_dtypes"] = tuple((n, b.dtype) for n, b in model.named_buffers() if b.is_floating_point())
    full = model.state_dict()  # a collective at stage 3
    out["state_dict_keys"] = list(full.keys()) if rank == 0 else None
    out["keys_expected"] = keys if rank == 0 else None
    names = {n for n, _ in model.named_parameters()}
    out["weights"] = {n: t.float().clone() for n, t in full.items() if n in names} if rank == 0 else None
    out["losses"] = losses
    assert all(math.isfinite(v) for v in losses)
    return out


def run_cases(rank: int, world: int, cases: list[Case]) -> dict[str, dict]:
    return {case.name: train_zeroinf(case, rank, world) for case in cases}
