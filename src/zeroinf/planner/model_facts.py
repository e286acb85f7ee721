"""What the planner needs to know about a model, read without touching its weights.

A model comes as a demo preset name, a Hugging Face folder or config.json (built on the meta
device: `AutoModelForCausalLM.from_config` under `torch.device("meta")`, no weight is read), or a
module (built under `zeroinf.init()`, on the meta device, or real). From it:
- the units (`UnitShape`s from the engine's own unit discovery), which feed the per-unit plan;
- one forward pass on meta tensors (shapes and dtypes only, no memory; attention goes to the fused
  kernel the training device would pick, see `_attention_as_on`, so the CPU flash attention's saved
  tensors are the real ones; meta rather than `FakeTensorMode`, whose import of torch._dynamo
  alone costs about 2 s of a plan that must answer in under 5):
  the bytes autograd saves for backward, per unit and outside units, the inputs each unit would
  keep under activation checkpointing, the largest single tensor, the matmul FLOPs by operand size
  and the memory traffic of the other operators. Measured, not guessed: a custom module gets the
  same treatment as the demo GPT, as long as the planner knows how to call it (`example_inputs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import json
import math
import re
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from zeroinf.config import DTYPES, Config
from zeroinf.partition.wrap import discover_units
from zeroinf.planner.unit_plan import UnitShape
from zeroinf.precision import buffer_in_compute_dtype

SHORT_BLOCKS = 2  # blocks of the shortened model a deep model's pass is measured on
ExampleInputs = Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
"""(micro_batch, seq_len) -> (args, kwargs) of one training forward that returns the loss."""


@dataclass(frozen=True)
class PassFacts:
    """One training forward at (micro_batch, seq_len, dtype), as measured on meta tensors. Plain data."""

    micro_batch: int
    seq_len: int
    dtype: str
    saved_bytes: int
    """Bytes autograd keeps for backward (parameters excluded), without activation checkpointing."""
    root_saved_bytes: int
    """Of those, the bytes saved outside every checkpointable unit (embeddings, head, loss)."""
    unit_saved_bytes: tuple[int, ...]
    """Per checkpointable (outermost, non-root) unit, in order."""
    unit_input_bytes: tuple[int, ...]
    """The inputs each of those units would keep under activation checkpointing."""
    largest_tensor_bytes: int
    root_matmul_flops: tuple[tuple[int, int], ...]
    """(operand size, FLOPs) of the forward's matmuls outside units; size = cube root of m*n*k, rounded
    to a power of two."""
    unit_matmul_flops: tuple[tuple[int, int], ...]
    """The same inside checkpointable units (what a checkpointed backward recomputes)."""
    other_bytes: int
    """Bytes read and written by the forward's other operators (element-wise, norms, softmax...)."""
    unit_other_bytes: int

    @property
    def matmul_flops_by_size(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for size, flops in self.root_matmul_flops + self.unit_matmul_flops:
            out[size] += flops
        return dict(out)

    @property
    def matmul_flops(self) -> int:
        return sum(f for _, f in self.root_matmul_flops + self.unit_matmul_flops)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class ModelFacts:
    """A model's units and how to measure a pass of it; `pass_facts` is cached per shape and dtype."""

    name: str
    units: tuple[UnitShape, ...]
    param_count: int
    seq_len: int | None
    """The model's context length, when it has one (the default sequence length of a plan)."""
    module: nn.Module | None = field(default=None, repr=False)
    example_inputs: ExampleInputs | None = field(default=None, repr=False)
    unit_classes: tuple[str, ...] = ()
    short_module: Callable[[], nn.Module] | None = field(default=None, repr=False)
    """Builds the same model with fewer repeated blocks (on the meta device): the pass is measured on
    it and its last block repeated up to the full depth, so a 70B plan needs no 80-block pass."""
    outer_count: int | None = None
    """Checkpointable units of the full model when `module` is a shortened one (a deep HF model)."""
    param_order: dict[str, int] = field(default_factory=dict, repr=False)
    """Position in `named_parameters` of the root's and the split layers' parameters: a layer a config
    does not split goes back into the root where the engine's root holds it."""
    _passes: dict[tuple[int, int, str], PassFacts] = field(default_factory=dict, repr=False)
    pass_error: str | None = None
    """Why the forward could not run on meta tensors (a forward that reads values: JetMoE's expert
    routing calls `.tolist()`), or None; the plan then estimates without measured activations."""

    def units_for(self, cfg: Config) -> tuple[UnitShape, ...]:
        """The units the engine builds under `cfg`: `units` holds every layer `Config.split_root` may
        split as a unit of its own; those `cfg` leaves in the root (stages 0-2, the split off, smaller
        than a block or its threshold) are merged back into it, in the engine's parameter order."""
        min_numel = cfg.split_min_numel
        size: dict[str, int] = defaultdict(int)  # a module's parameters: a unit and its frozen twin together
        for u in self.units:
            size[u.name] += u.numel
        if min_numel is not None and not cfg.split_any_size:  # at least as large as a block
            split = {u.name for u in self.units if u.split}
            names = [n for n in size if n and n not in split]
            outer = [n for n in names if not any(n.startswith(f"{o}.") for o in names)]
            if outer:
                min_numel = max(min_numel, min(size[n] for n in outer))
        keep = [u for u in self.units if not u.split or (min_numel is not None and size[u.name] >= min_numel)]
        if len(keep) == len(self.units):
            return self.units
        out: list[UnitShape] = []
        for frozen in (False, True):
            group = [u for u in keep if u.frozen == frozen and u.name]
            merged = [p for u in self.units if u.frozen == frozen and (u.name == "" or u not in keep) for p in u.params]
            if merged:
                merged.sort(key=lambda p: self.param_order.get(p[0], 0))
                group.append(UnitShape("", tuple(merged), frozen))
            out += group
        return tuple(out)

    def pass_facts(self, micro_batch: int, seq_len: int, dtype: str, device: torch.device) -> PassFacts | None:
        """The facts of one forward, or None when the planner cannot call this module."""
        key = (micro_batch, seq_len, dtype)
        if key not in self._passes:
            if self.module is None or self.example_inputs is None:
                return None
            module = self.short_module() if self.short_module is not None else self.module
            try:
                facts = measure_pass(
                    module, self.example_inputs, micro_batch, seq_len, dtype, device, self.unit_classes
                )
            except (NotImplementedError, RuntimeError) as exc:  # meta tensors have shapes, not values
                self.pass_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                return None
            full = self.outer_count
            if full is None:
                full = len(outer_units(self.module, self.unit_classes))
            self._passes[key] = extend_pass(facts, full) if len(facts.unit_saved_bytes) < full else facts
        return self._passes[key]


def extend_pass(facts: PassFacts, units: int) -> PassFacts:
    """The facts of a shortened model extended to `units` blocks by repeating its last block."""
    k = len(facts.unit_saved_bytes)
    if k == 0:
        return facts
    extra = units - k
    per_unit_other = facts.unit_other_bytes // k
    saved = facts.unit_saved_bytes + (facts.unit_saved_bytes[-1],) * extra
    return dataclasses.replace(
        facts,
        saved_bytes=facts.root_saved_bytes + sum(saved),
        unit_saved_bytes=saved,
        unit_input_bytes=facts.unit_input_bytes + (facts.unit_input_bytes[-1],) * extra,
        unit_matmul_flops=tuple((size, flops * units // k) for size, flops in facts.unit_matmul_flops),
        other_bytes=facts.other_bytes + per_unit_other * extra,
        unit_other_bytes=facts.unit_other_bytes + per_unit_other * extra,
    )


def outer_units(module: nn.Module, unit_classes: tuple[str, ...] = ()) -> list[Any]:
    """The unit specs activation checkpointing wraps: outermost, not the root (as the engine picks them)."""
    specs = [s for s in discover_units(module, unit_classes) if s.name]
    paths = {s.name for s in specs}
    return [s for s in specs if not any(s.name.startswith(f"{o}.") for o in paths)]


# -- sources ------------------------------------------------------------------------------------------
def gpt_inputs(micro_batch: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    idx = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return (idx, idx), {}


def hf_inputs(micro_batch: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    idx = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return (), {"input_ids": idx, "labels": idx}


def from_preset(name: str, unit_classes: tuple[str, ...] = (), **overrides: Any) -> ModelFacts:
    """A demo GPT preset (zeroinf.models.gpt.PRESETS), built on the meta device."""
    from zeroinf.models.gpt import GPTConfig

    return from_gpt_config(GPTConfig.preset(name, **overrides), unit_classes, name=f"GPT {name}")


def from_gpt_config(gpt: Any, unit_classes: tuple[str, ...] = (), name: str = "GPT") -> ModelFacts:
    from zeroinf.models.gpt import GPT

    def build(n_layer: int) -> nn.Module:
        with _on_meta():
            return GPT(dataclasses.replace(gpt, n_layer=n_layer))

    facts = from_module(build(gpt.n_layer), gpt_inputs, unit_classes, name=name, seq_len=gpt.seq_len)
    if gpt.n_layer > SHORT_BLOCKS and not unit_classes:
        facts.short_module = lambda: build(SHORT_BLOCKS)
    return facts


def from_hf(path: str | Path, unit_classes: tuple[str, ...] = (), auto_class: Any = None) -> ModelFacts:
    """A Hugging Face model from its folder or config.json, built on the meta device (no weight
    read): a causal LM where transformers has one for the config, else an image-text-to-text model
    (a VLM: LLaVA, Qwen-VL, Gemma 3), else the bare model; `auto_class` chooses instead."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"--hf {str(path)!r}: no config.json there; pass a model folder or its config.json")
    try:
        data = _special_floats(json.loads(config_file.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} is not a Hugging Face model config (a JSON object)")
    model_type = data.get("model_type")
    if not model_type:
        raise ValueError(f"{config_file} has no model_type: it is not a Hugging Face model config")
    name = f"{(data.get('architectures') or [model_type])[0]} ({config_file.parent.name or config_file.name})"
    from zeroinf.planner import decoder

    if decoder.supports(data) and not unit_classes:  # Llama-family: built here, no transformers import
        return _from_decoder(data, name)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ImportError("reading a Hugging Face config needs transformers: pip install 'zeroinf[hf]'") from None
    config = AutoConfig.for_model(**data)
    auto = auto_class or auto_class_for(config)
    seq_len = getattr(config, "max_position_embeddings", None)
    layers = getattr(config, "num_hidden_layers", None)
    uniform = not any(key in data for key in ("layer_types", "block_types", "hybrid_override_pattern"))
    if isinstance(layers, int) and layers > SHORT_BLOCKS and uniform and not unit_classes:
        # A deep model of identical blocks: build SHORT_BLOCKS of them and repeat the last one's
        # shapes (an 80-block 70B model is then planned in about a second, its pass measured short).
        short_config = AutoConfig.for_model(**{**data, "num_hidden_layers": SHORT_BLOCKS})
        with _on_meta():
            short = auto.from_config(short_config)
        facts = from_module(short, hf_inputs, unit_classes, name=name, seq_len=seq_len)
        expanded = expand_blocks(facts.units, SHORT_BLOCKS, layers)
        if expanded is not None:
            units, per_block = expanded
            facts.units = units
            facts.param_count += (layers - SHORT_BLOCKS) * per_block
            facts.outer_count = layers
            return facts
    with _on_meta():
        model = auto.from_config(config)
    facts = from_module(model, hf_inputs, unit_classes, name=name, seq_len=seq_len)
    if isinstance(layers, int) and layers > SHORT_BLOCKS and uniform and not unit_classes:

        def short_module() -> nn.Module:
            with _on_meta():
                short_config = AutoConfig.for_model(**{**data, "num_hidden_layers": SHORT_BLOCKS})
                return auto.from_config(short_config)

        facts.short_module = short_module
    return facts


def _special_floats(data: Any) -> Any:
    """transformers writes floats JSON lacks as {"__float__": "Infinity"} (Falcon-H1's time_step_limit)
    and reads them back in `from_pretrained`; the planner builds configs from the dict itself."""
    if isinstance(data, dict):
        if set(data) == {"__float__"} and data["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(data["__float__"].lower().replace("infinity", "inf"))
        return {k: _special_floats(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_special_floats(v) for v in data]
    return data


def auto_class_for(config: Any) -> Any:
    """The auto class that builds `config`'s model for training (see `from_hf`; `zeroinf.from_pretrained`
    builds with it too), its model class
    imported (transformers imports model modules lazily) before the meta build: a model module imports
    what the dynamo stand-in of `_dynamo_import_deferred` cannot serve (torch._dynamo's submodules,
    through transformers' generation utilities; torch.distributed.tensor, whose custom ops re-enter
    a half-done import). `zeroinf plan --hf` of a Mixtral stopped there; of any VLM (Qwen3-VL-MoE,
    LLaVA) it stopped in AutoModelForCausalLM, which has no class for their configs."""
    import transformers
    from transformers.models.auto import modeling_auto

    for auto, mapping in (
        (transformers.AutoModelForCausalLM, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING),
        (transformers.AutoModelForImageTextToText, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING),
        (transformers.AutoModel, modeling_auto.MODEL_MAPPING),
    ):
        try:
            mapping[type(config)]
        except KeyError:
            continue
        return auto
    return transformers.AutoModelForCausalLM  # from_config names the problem


def _from_decoder(data: dict[str, Any], name: str) -> ModelFacts:
    """Facts of a Llama-family config through planner/decoder.py (same names and shapes as transformers)."""
    from zeroinf.planner.decoder import Decoder

    layers = int(data["num_hidden_layers"])
    short = min(layers, SHORT_BLOCKS)
    with _on_meta():
        model = Decoder({**data, "num_hidden_layers": short})
    facts = from_module(model, hf_inputs, name=name, seq_len=data.get("max_position_embeddings"))
    if layers > short:
        expanded = expand_blocks(facts.units, short, layers)
        if expanded is None:  # not shaped as expected: the whole model
            with _on_meta():
                return from_module(Decoder(data), hf_inputs, name=name, seq_len=data.get("max_position_embeddings"))
        facts.units, per_block = expanded
        facts.param_count += (layers - short) * per_block
        facts.outer_count = layers
    return facts


def expand_blocks(
    units: tuple[UnitShape, ...], short: int, full: int
) -> tuple[tuple[UnitShape, ...], int] | None:
    """The units of a model of `full` identical blocks from those of the same model with `short`
    blocks (units `<prefix>.0` .. `<prefix>.<short-1>`), and the elements of one block; None when the
    units are not shaped like that."""
    blocks = [(i, u) for i, u in enumerate(units) if re.fullmatch(r".+\.\d+", u.name) and not u.frozen]
    if len(blocks) != short:
        return None
    prefix = blocks[0][1].name.rsplit(".", 1)[0]
    if [u.name for _, u in blocks] != [f"{prefix}.{i}" for i in range(short)]:
        return None
    first, last = blocks[0][0], blocks[-1][0]
    if last - first != short - 1:
        return None
    template = blocks[-1][1]
    old = f"{prefix}.{short - 1}."

    def block(i: int) -> UnitShape:
        if i < short:
            return blocks[i][1]
        new = f"{prefix}.{i}."
        params = tuple((new + n[len(old):] if n.startswith(old) else n, s) for n, s in template.params)
        # after the template block's modules, before the next unit's (whose order is at least one more)
        return UnitShape(f"{prefix}.{i}", params, order=template.order + (i - short + 1) / (full + 1))

    out = units[:first] + tuple(block(i) for i in range(full)) + units[last + 1 :]
    return out, template.numel


def from_module(
    model: nn.Module,
    example_inputs: ExampleInputs | None,
    unit_classes: tuple[str, ...] = (),
    name: str | None = None,
    seq_len: int | None = None,
) -> ModelFacts:
    """Any module: real, on the meta device, or built under `zeroinf.init()` (parked parameters).
    Every layer `Config.split_root` may split is a unit here; `ModelFacts.units_for` merges the ones
    a config leaves in the root back into it, as the engine builds them."""
    specs = discover_units(model, unit_classes, split_min_numel=1, split_any_size=True)
    if not specs:
        raise ValueError("the model has no trainable parameters: nothing to plan")
    units = tuple(UnitShape.of(spec) for spec in specs)
    count = sum(p.numel() for p in model.parameters())
    if seq_len is None:
        seq_len = getattr(getattr(model, "cfg", None), "seq_len", None)
    outside = {n for u in units if u.split or not u.name for n, _ in u.params}
    order = {n: i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False)) if n in outside}
    return ModelFacts(
        name or type(model).__name__, units, count, seq_len, model, example_inputs, unit_classes, param_order=order
    )


# -- one forward on meta tensors ------------------------------------------------------------------------
def _size_bucket(flops: int) -> int:
    """Cube root of m*n*k for a matmul of `flops` = 2*m*n*k, rounded to a power of two (>= 16)."""
    side = (max(flops, 2) / 2) ** (1 / 3)
    return max(16, 2 ** round(math.log2(side)))


def _sdpa_cpu_flops(args: tuple, kwargs: dict) -> int:
    q, k = args[0], args[1]
    *batch, tq, d = q.shape
    tk = k.shape[-2]
    flops = 4 * math.prod(batch) * tq * tk * d
    causal = kwargs.get("is_causal", args[4] if len(args) > 4 else False)
    return flops // 2 if causal else flops


_PLANNED_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("zeroinf_planned_device", default=None)


def device_type_of(t: torch.Tensor) -> str:
    """`t.device.type`, except in the planner's meta pass: the device type that pass stands for.

    For model code that picks a path by device (the demo GPT upcasts attention on CPUs), so the
    pass measures the path training will take."""
    planned = _PLANNED_DEVICE.get() if t.device.type == "meta" else None
    return planned or t.device.type


_FLASH, _EFFICIENT = 1, 2  # torch.nn.attention.SDPBackend values that `torch._fused_sdp_choice` returns


def _backend_choice(device: torch.device, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Any, dropout_p: float, is_causal: bool, enable_gqa: bool) -> int:
    """The SDPA kernel PyTorch picks on `device` for inputs like these: asked on tiny real tensors of
    the same dtype, heads and head sizes (the choice does not depend on the sequence length). The
    value's head size counts: flash kernels need it equal to the query's (DeepSeek-V3's is not; the
    plan of such a model took the flash kernel's output shape and stopped in the next matmul)."""
    if device.type == "cuda" and not torch.cuda.is_available():  # planning for a GPU from a CPU machine
        flash = attn_mask is None and query.dtype in (torch.float16, torch.bfloat16)
        return _FLASH if flash and value.shape[-1] == query.shape[-1] else _EFFICIENT

    def tiny(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*t.shape[:-2], 2, t.shape[-1], dtype=t.dtype, device=device, requires_grad=t.requires_grad)

    with _disable_current_modes():  # the pass's counter must not see these tensors
        mask = None
        if isinstance(attn_mask, torch.Tensor):
            mask = torch.zeros(*(min(n, 1) for n in attn_mask.shape[:-2]), 2, 2, dtype=attn_mask.dtype, device=device)
        q, k, v = tiny(query), tiny(key), tiny(value)
        return int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, enable_gqa=enable_gqa))


@contextlib.contextmanager
def _on_meta() -> Iterator[None]:
    """Build modules on the meta device (their init's Python meta kernels without the dynamo import)."""
    with torch.device("meta"), _dynamo_import_deferred():
        yield


@contextlib.contextmanager
def _dynamo_import_deferred() -> Iterator[None]:
    """Keep the meta pass from importing torch._dynamo (about 2 s of a plan that must take under 5).

    PyTorch's meta kernels written in Python are wrapped by `torch._compile._disable_dynamo`, whose
    first call imports torch._dynamo only to wrap the kernel so that dynamo will not trace it.
    Nothing is compiled during the pass, so a stand-in module answers that import with the kernel
    itself; afterwards the stand-in and the kernels' cached wrappers are removed, and the next
    call anywhere imports the real module as usual. Any other use of the stand-in imports the real
    module at once (slower, never wrong).
    """
    if "torch._dynamo" in sys.modules:
        yield
        return
    touched: list[Any] = []
    stand_in = types.ModuleType("torch._dynamo")

    def disable(fn: Any, recursive: bool = True, wrapping: bool = True) -> Any:
        touched.append(fn)
        return fn

    def real(name: str) -> Any:
        if name.startswith("__"):  # a module's metadata (inspect.getmodule asks every module for __file__
            # while torch's custom ops register, inside a torch.distributed.tensor import that the
            # real dynamo import would then re-enter half-done): the stand-in has none
            raise AttributeError(name)
        _remove_stand_in(stand_in)
        return getattr(importlib.import_module("torch._dynamo"), name)

    # The ignores: attributes of a module object set at run time; typeshed declares the module-level
    # __getattr__ (PEP 562) as a method of ModuleType.
    stand_in.disable = disable  # type: ignore[attr-defined]
    stand_in.__getattr__ = real  # type: ignore[method-assign]
    sys.modules["torch._dynamo"] = stand_in
    try:
        yield
    finally:
        _remove_stand_in(stand_in)
        for fn in touched:
            vars(fn).pop("__dynamo_disable", None)


def _remove_stand_in(stand_in: types.ModuleType) -> None:
    if sys.modules.get("torch._dynamo") is stand_in:
        del sys.modules["torch._dynamo"]
    if vars(torch).get("_dynamo") is stand_in:
        delattr(torch, "_dynamo")


@contextlib.contextmanager
def _attention_as_on(device: torch.device) -> Iterator[None]:
    """Route `F.scaled_dot_product_attention` on meta tensors to the fused kernel `device` would run.

    On meta tensors PyTorch cannot see the device and takes the math kernel, which saves the whole
    attention matrix for backward; the fused kernels save the output and a log-sum-exp. Calling the
    chosen kernel's own op keeps the saved tensors (and FLOPs) those of the real run.
    """
    original = F.scaled_dot_product_attention

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        args = (query, key, value)
        if query.device.type == "meta":
            backend = _backend_choice(device, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            aten = torch.ops.aten
            if backend == _FLASH and device.type == "cpu":
                return aten._scaled_dot_product_flash_attention_for_cpu(
                    *args, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
            if backend == _FLASH and attn_mask is None and not enable_gqa:
                return aten._scaled_dot_product_flash_attention(*args, dropout_p, is_causal, scale=scale)[0]
            if backend == _EFFICIENT and not enable_gqa:
                return aten._scaled_dot_product_efficient_attention(
                    *args, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return original(*args, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    token = _PLANNED_DEVICE.set(device.type)
    try:
        yield
    finally:
        _PLANNED_DEVICE.reset(token)
        F.scaled_dot_product_attention = original


class _PassCounter(TorchDispatchMode):
    """Counts matmul FLOPs (by size) and the bytes other operators move, attributed to the current unit."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.in_unit = False
        self.flops: dict[tuple[bool, int], int] = defaultdict(int)  # (in a unit, size) -> FLOPs
        self.other_bytes = 0
        self.unit_other_bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = 0
        if packet in self.registry:
            flops = int(self.registry[packet](*args, **kwargs, out_val=out))
        elif "scaled_dot_product" in packet.__name__:
            flops = _sdpa_cpu_flops(args, kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            self.largest = max(self.largest, t.numel() * t.element_size())
        if flops:
            self.flops[(self.in_unit, _size_bucket(flops))] += flops
            return out
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        in_storages = {t.untyped_storage()._cdata for t in ins}
        if any(t.untyped_storage()._cdata in in_storages for t in outs):
            return out  # a view or an in-place op on its input: no new memory traffic counted
        moved = sum(t.numel() * t.element_size() for t in ins + outs)
        self.other_bytes += moved
        self.unit_other_bytes += moved if self.in_unit else 0
        return out


def _meta_model_state(module: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """Meta copies of the module's parameters (in `dtype`) and buffers."""

    state: dict[str, Any] = {}
    made: dict[int, nn.Parameter] = {}  # tied parameters stay one object
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            on_meta = p.detach().to("meta")
            made[id(p)] = nn.Parameter(on_meta.to(dtype) if on_meta.is_floating_point() else on_meta,
                                       requires_grad=p.requires_grad)
        state[name] = made[id(p)]
    # as the engine casts them: MiniMax's persistent fp32 decay buffers, kept in fp32 here, met bf16
    # activations in a matmul and stopped the pass
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for bname, b in sub._buffers.items():
            if b is not None:
                on_meta = buffer_in_compute_dtype(sub, bname, b.detach().to("meta"), dtype)
                state[f"{prefix}.{bname}" if prefix else bname] = on_meta
    return state


def measure_pass(
    module: nn.Module,
    example_inputs: ExampleInputs,
    micro_batch: int,
    seq_len: int,
    dtype: str,
    device: torch.device,
    unit_classes: tuple[str, ...] = (),
) -> PassFacts:
    """One training forward of `module` on meta tensors: saved bytes per unit, FLOPs, traffic."""
    torch_dtype = DTYPES[dtype]
    outer = outer_units(module, unit_classes)
    state = _meta_model_state(module, torch_dtype)
    param_ids = {id(v) for v in state.values() if isinstance(v, nn.Parameter)}
    counter = _PassCounter()
    current: list[int] = []  # stack of outermost units running now
    saved = [0] * len(outer)
    inputs = [0] * len(outer)
    root_saved = 0
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal root_saved
        base = t
        while base._base is not None:
            base = base._base
        if id(base) in param_ids or id(t) in param_ids:
            return t
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            if current:
                saved[current[-1]] += nbytes
            else:
                root_saved += nbytes
        return t

    def pre(index: int, args: Any, kwargs: Any) -> None:
        if not current:
            inputs[index] += sum(
                t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            )
        current.append(index)
        counter.in_unit = True

    def post(index: int) -> None:
        current.pop()
        counter.in_unit = bool(current)

    handles = []
    for i, spec in enumerate(outer):
        handles.append(spec.module.register_forward_pre_hook(lambda m, a, k, i=i: pre(i, a, k), with_kwargs=True))
        handles.append(spec.module.register_forward_hook(lambda m, a, o, i=i: post(i)))
    try:
        with torch.device("meta"):
            args, kwargs = example_inputs(micro_batch, seq_len)
        args, kwargs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
        saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with _dynamo_import_deferred(), _attention_as_on(device), counter, saving:
            torch.func.functional_call(module, state, args, kwargs, strict=False)
    finally:
        for h in handles:
            h.remove()
    return PassFacts(
        micro_batch, seq_len, dtype,
        saved_bytes=root_saved + sum(saved),
        root_saved_bytes=root_saved,
        unit_saved_bytes=tuple(saved),
        unit_input_bytes=tuple(inputs),
        largest_tensor_bytes=counter.largest,
        root_matmul_flops=tuple(sorted((s, f) for (u, s), f in counter.flops.items() if not u)),
        unit_matmul_flops=tuple(sorted((s, f) for (u, s), f in counter.flops.items() if u)),
        other_bytes=counter.other_bytes,
        unit_other_bytes=counter.unit_other_bytes,
    )
