"""The stored tensors of a Hugging Face folder under the model's own names, through transformers'
checkpoint conversions, still read by element ranges.

Since transformers 5 a model's parameters need not be its files' tensors. Renamings: GPT-NeoX's
`embed_out` is `lm_head`, Mixtral's `block_sparse_moe` is `mlp`. Fusions: Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V3 and most MoE models hold each layer's experts as 3-D parameters
(`mlp.experts.down_proj` = every expert's `w2` stacked; `mlp.experts.gate_up_proj` = the stacks of
`w1` and `w3` concatenated along dim 1), while the files on the Hub, and what `save_pretrained`
writes back, keep one tensor per expert and matrix. transformers' loader reads the pieces whole and
runs the operations; zeroinf reads each rank's shard as byte ranges (safetensors_folder.py), so a
fused parameter becomes a `ComposedTensor`: its flattened elements as ordered ranges of the stored
pieces (a stack appends them; a concatenation along dim d takes each piece's block of
prod(shape[d:]) elements in turn). A shard of a fused parameter is then a few contiguous reads,
no byte is read by two ranks, and no layer's experts are ever whole in memory.

Which stored key feeds which parameter, and in which order, is transformers' own answer
(`get_model_conversion_mapping`, `rename_source_key`, keys in `dot_natural_key` order as its loader
collects them), so the mapping follows the installed version. Stacking along dim 0 and
concatenation are the operations of nearly every conversion transformers defines; any other
(splitting a fused qkv, transposes, RoPE permutations) is refused naming the parameter and the
operation, before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zeroinf.weights.safetensors_folder import (
    SafetensorsFolder,
    Stored,
    WeightsError,
    concatenate,
    stack,
)


def model_keyed(folder: SafetensorsFolder, model: nn.Module, names: Iterable[str]) -> dict[str, Stored] | None:
    """`folder`'s tensors keyed by the names of `model` (a transformers `PreTrainedModel`; `names`:
    its state_dict names), or None where transformers defines no conversion for it (or is older
    than 5): the stored keys are then the names. A stored key no conversion maps to a name keeps its
    own key (the caller reports it as unexpected)."""
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
    model_names = dict.fromkeys(names, True)  # what transformers' rename asks of a meta state_dict
    prefix = getattr(model, "base_model_prefix", None) or None
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    out: dict[str, Stored] = {}
    fused: dict[str, tuple[WeightConverter, dict[str, list[Stored]]]] = {}
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
            converter, pieces = fused.setdefault(name, (converter_of[pattern], {}))
            pieces.setdefault(pattern, []).append(folder[key])
    for name, (converter, pieces) in fused.items():
        if name in out:
            raise WeightsError(f"{folder.path}: {name!r} is stored whole ({out[name].key!r}) and in pieces")
        out[name] = _fuse(folder, name, converter, pieces)
    return out


def _fuse(folder: SafetensorsFolder, name: str, converter: object, pieces: dict[str, list[Stored]]) -> Stored:
    """The parameter `name` as transformers' `converter` builds it from `pieces` (per source
    pattern, in loading order): its operations replayed on ranges instead of values."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    state: dict[str, list[Stored]] = {p: list(ts) for p, ts in pieces.items()}
    for op in getattr(converter, "operations", []):
        if type(op) is MergeModulelist and op.dim == 0:
            state = {p: [stack(name, ts)] for p, ts in state.items()}
        elif type(op) is Concatenate:
            order = getattr(converter, "source_patterns", list(state))
            parts = [t for p in order if p in state for t in state[p]]
            state = {name: [concatenate(name, parts, op.dim)]}
        else:
            keys = [t.key for ts in pieces.values() for t in ts]
            raise WeightsError(
                f"{folder.path}: the model's {name!r} is built from {keys[:3]} by transformers' "
                f"{type(op).__name__}{vars(op)}, which zeroinf cannot read by ranges (it reads stacking and "
                "concatenation); build the model with transformers' from_pretrained and zeroinf.shard it"
            )
    results = [t for ts in state.values() for t in ts]
    if len(results) != 1:
        raise WeightsError(f"{folder.path}: the conversion of {name!r} gives {len(results)} tensors, not one")
    return results[0]
