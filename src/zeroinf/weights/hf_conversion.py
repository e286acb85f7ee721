"""The stored tensors of a Hugging Face folder under the model's own names, through transformers'
checkpoint conversions, still read by element ranges.

Since transformers 5 a model's parameters need not be its files' tensors. Renamings: GPT-NeoX's
`embed_out` is `lm_head`, Mixtral's `block_sparse_moe` is `mlp`. Fusions: Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V3 and most MoE models hold each layer's experts as 3-D parameters
(`mlp.experts.down_proj` = every expert's `w2` stacked; `mlp.experts.gate_up_proj` = the stacks of
`w1` and `w3` concatenated along dim 1), while the files on the Hub, and what `save_pretrained`
writes back, keep one tensor per expert and matrix. Splits, the other way round: gte, nomic-bert
and jina-embeddings-v3 store a layer's q, k and v as one `qkv` tensor the model holds as three
(`Chunk`: equal parts), Sarvam-MoE its GQA `query_key_value` (`Split`: each target's size).
Transposes: Qwen3-VL-MoE's Hub files store the experts (experts, in, out), the model holds them
(experts, out, in).
transformers' loader reads the pieces whole and runs the operations; zeroinf reads each rank's
shard as byte ranges (safetensors_folder.py), so a converted parameter becomes a
`ComposedTensor`: its flattened elements as ordered ranges of the stored tensors (a stack appends
them; a concatenation along dim d takes each piece's block of prod(shape[d:]) elements in turn; a
split along dim d takes its block of each row of the dims before d). A shard of a converted
parameter is then a few contiguous reads, no byte is read by two ranks, and no layer's experts are
ever whole in memory. A transposed tensor is no ranges of the files: it is read as the whole blocks
it falls in (one expert's matrix) and transposed in memory (`TransposedTensor`), so it must be the
converter's last operation.

Which stored key feeds which parameter, and in which order, is transformers' own answer
(`get_model_conversion_mapping`, `rename_source_key`, keys in `dot_natural_key` order as its loader
collects them), so the mapping follows the installed version. Stacking along dim 0, concatenation,
splitting, RoPE row permutations (`PermuteForRope`: rows moved within each head, each row a range;
Mistral Large 4's and Kimi-K2.5's vision towers) and a final transpose are the operations of most
conversions transformers defines (of the 86 tables with tensor operations in 5.24, 80 use nothing
else); any other (interleaving, model-specific ones) is refused naming the parameter and the
operation, before anything is read. Saving reverts them with transformers' own code, the model asked for its
parameters' full shapes (a transpose with `check_dims` compares them), not a shard's placeholders.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from zeroinf.telemetry import get_logger
from zeroinf.weights.safetensors_folder import (
    ComposedTensor,
    Ranged,
    SafetensorsFolder,
    Stored,
    TransposedTensor,
    WeightsError,
    chunk_sizes,
    concatenate,
    permute_rows,
    split,
    stack,
    transpose,
)
from zeroinf.weights.source import persistent_buffers


def key_by_model(
    folder: SafetensorsFolder, model: nn.Module, shapes: Mapping[int, tuple[int, ...]] | None = None
) -> None:
    """Key `folder`'s tensors by the state_dict names of `model` where it is a transformers model with
    checkpoint conversions (`from_pretrained` before `prepare`, `load_weights`); else leave them.
    `shapes`: the parameters' full shapes by id where the model holds placeholders (a sharded model)."""
    if transformers_model(model) is None:
        return
    named = [(n, tuple((shapes or {}).get(id(p), p.shape))) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(n, tuple(b.shape)) for n, b in persistent_buffers(model)]
    keyed = _model_keyed(folder, model, dict(named))
    if keyed is not None:
        folder.tensors = keyed


def _model_keyed(
    folder: SafetensorsFolder, model: nn.Module, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Stored] | None:
    """`folder`'s tensors keyed by the names of `model` (a transformers `PreTrainedModel`; `shapes`:
    its state_dict names and shapes), or None where transformers defines no conversion for it (or is
    older than 5): the stored keys are then the names. A stored key no conversion maps to a name
    keeps its own key (the caller reports it as unexpected)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers < 5: no conversions
        return None
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return None
    model_names = dict.fromkeys(shapes, True)  # what transformers' rename asks of a meta state_dict
    prefix = getattr(model, "base_model_prefix", None) or None
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    out: dict[str, Stored] = {}
    converted: dict[str, tuple[WeightConverter, dict[str, list[Stored]]]] = {}
    for key in sorted(folder, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, model_names)
        if name not in model_names and key in model_names:  # a key renamed away from its own name
            name, pattern = rename_source_key(key, [], [], prefix, model_names)
        if name not in model_names:
            name, pattern = key, None
        if pattern is None:
            if name in out:
                raise WeightsError(f"{folder.path}: stored tensors {out[name].key!r} and {key!r} are both {name!r}")
            out[name] = folder[key]
        else:
            converter, pieces = converted.setdefault(name, (converter_of[pattern], {}))
            pieces.setdefault(pattern, []).append(folder[key])
    for name, (converter, pieces) in converted.items():
        for target, stored in _convert(folder, name, converter, pieces, shapes, model.config).items():
            if target in out:
                raise WeightsError(f"{folder.path}: {target!r} is stored whole ({out[target].key!r}) and in pieces")
            out[target] = stored
    # as transformers' loader does: saving reverts the conversions this folder needed (`hub_layout`)
    setattr(model, "_weight_conversions", [t for t in transforms if t.was_used()])  # noqa: B010
    return out


def _convert(
    folder: SafetensorsFolder, name: str, converter: Any, pieces: dict[str, list[Stored]],
    shapes: dict[str, tuple[int, ...]], config: Any,
) -> dict[str, Stored]:
    """The parameters transformers' `converter` builds from `pieces` (per source pattern, in loading
    order), by name: its operations replayed on ranges instead of values. `name` is the first
    target's (what transformers' rename gives); a split's other targets are named as its loader
    names them, the first target pattern in `name` replaced by each. A transpose is read by blocks
    (safetensors_folder.TransposedTensor), so it must be the last operation."""
    import transformers.core_model_loading as loading
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, PermuteForRope, Transpose

    # Split came after transformers 5.17
    splits = tuple(op for op in (Chunk, getattr(loading, "Split", None)) if op is not None)

    targets = converter.target_patterns
    state: dict[str, list[Stored]] = {p: list(ts) for p, ts in pieces.items()}

    def refuse(op: Any) -> WeightsError:
        keys = [t.key for ts in pieces.values() for t in ts]
        return WeightsError(
            f"{folder.path}: the model's {name!r} is built from {keys[:3]} by transformers' "
            f"{type(op).__name__}{vars(op)}, which zeroinf cannot read by ranges (it reads stacking, "
            "concatenation, splitting, RoPE permutations and a final transpose); build the model with "
            "transformers' from_pretrained and zeroinf.shard it"
        )

    for op in converter.operations:
        if any(isinstance(t, TransposedTensor) for ts in state.values() for t in ts):
            raise refuse(op)  # a transposed tensor is no ranges: it feeds no other operation
        ranged = cast(dict[str, list[Ranged]], state)
        single = next(iter(state.values())) if [len(ts) for ts in state.values()] == [1] else None
        if type(op) is MergeModulelist and op.dim == 0:
            state = {p: [stack(name, ts)] for p, ts in ranged.items()}
        elif type(op) is Concatenate:
            parts = [t for p in converter.source_patterns if p in ranged for t in ranged[p]]
            state = {targets[0]: [concatenate(name, parts, op.dim)]}
        elif (
            type(op) in splits and getattr(op, "num_shards_attribute", None) is None
            and single is not None and targets[0] in name
        ):
            (whole,) = next(iter(ranged.values()))
            head, _, tail = name.partition(targets[0])
            names = [head + target + tail for target in targets]
            if type(op) is not Chunk:  # Split: sized like each target's model parameter
                sizes = [shapes[n][op.dim] if n in shapes else -1 for n in names]
            else:
                sizes = chunk_sizes(whole.shape[op.dim], len(targets))
            state = {target: [piece] for target, piece in zip(targets, split(names, whole, op.dim, sizes), strict=True)}
        elif type(op) is PermuteForRope and all(len(ts) == 1 for ts in ranged.values()):
            # rows moved within each head (interleaved RoPE pairs to rotate-half): each row one range;
            # the order is transformers' own permutation applied to the row indices
            permuted: dict[str, list[Stored]] = {}
            for key, (t,) in ranged.items():
                if op.permute_layer_names is None or any(n in key for n in op.permute_layer_names):
                    order = _rope_row_order(op, t.shape[0], config)
                    t = permute_rows(t.key if isinstance(t, ComposedTensor) else name, t, order)
                permuted[key if len(ranged) > 1 else targets[0]] = [t]
            state = permuted
        elif type(op) is Transpose and single is not None and len(targets) == 1:
            (whole,) = next(iter(ranged.values()))
            if op.check_dims and tuple(whole.shape) == shapes.get(name):  # stored as the model holds it
                continue
            state = {targets[0]: [transpose(name, whole, op.dim0, op.dim1)]}
        else:
            raise refuse(op)
    results = [t for ts in state.values() for t in ts]
    if len(results) == 1:
        return {name: results[0]}
    if all(isinstance(t, ComposedTensor) for t in results) and len(results) == len(targets):
        return {t.key: t for t in results}
    raise WeightsError(f"{folder.path}: the conversion of {name!r} gives {len(results)} tensors, not one")


def _rope_row_order(op: Any, rows: int, config: Any) -> list[int]:
    """The stored row each model row comes from under transformers' PermuteForRope: its own permutation
    applied to the row indices (named `_permute_for_rope(tensor, config)` after transformers 5.17,
    `_apply(tensor)` reading `op.config` before)."""
    index = torch.arange(rows)
    if hasattr(op, "_permute_for_rope"):
        return cast(list[int], op._permute_for_rope(index, config).tolist())
    op.config = config
    return cast(list[int], op._apply(index).tolist())


Revert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def hub_layout(model: nn.Module, groups: list[dict[str, torch.Tensor]]) -> Revert | None:
    """What transformers' `save_pretrained` does to the state dict of `model` before writing it
    (its checkpoint conversions reverted: the conversions its load used, or all of them for a model
    built from a config; fused experts written one tensor each), as a function applied to one group
    of tensors at a time (`groups`: every tensor to be written, on the meta device, by unit). None
    where reverting group by group would not give what reverting the whole state dict gives (a
    conversion that joins tensors of two units): the model's own names and layout are written then,
    which transformers loads as well."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: no conversions
        return None

    every = {name: t for group in groups for name, t in group.items()}

    def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Operations that ask the model for a parameter's shape (Transpose(check_dims=True): Qwen3-VL-MoE's
        # experts are written as the model holds them) must see its full shape, not a shard's placeholder
        model.__dict__["get_parameter"] = lambda target: (
            every[target] if target in every else type(model).get_parameter(model, target)
        )
        try:
            return dict(revert_weight_conversion(model, tensors))  # type: ignore[arg-type]
        finally:
            del model.__dict__["get_parameter"]

    try:
        whole = revert(every)
        parts = [revert(group) for group in groups if group]
    except Exception as exc:  # an operation that cannot run on a unit's tensors alone
        get_logger("weights").warning(f"writing the model's own layout: reverting its conversions failed ({exc!r})")
        return None
    by_name = {name: t for part in parts for name, t in part.items()}
    if sum(len(part) for part in parts) != len(by_name) or by_name.keys() != whole.keys() or any(
        (t.shape, t.dtype) != (whole[name].shape, whole[name].dtype) for name, t in by_name.items()
    ):
        get_logger("weights").warning(
            "writing the model's own layout: one of its checkpoint conversions spans two units"
        )
        return None
    return revert


def transformers_model(model: nn.Module) -> nn.Module | None:
    """`model` if it is a transformers `PreTrainedModel` (without importing transformers), else None."""
    transformers = sys.modules.get("transformers")
    return model if transformers is not None and isinstance(model, transformers.PreTrainedModel) else None
