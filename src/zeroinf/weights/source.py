"""Which stored tensor each parameter of a model takes, checked before anything is read, and the
per-unit reader that `shard` and `load_weights` use to fill one rank's shard from the files.

Matching is by `state_dict` name: a parameter takes the first of its names (tied parameters have
several) that the files hold. Names may come from before the model was wrapped (a PEFT model's
base layers keep their parameter objects, so the names recorded at construction still find them)
or through `key_map`. Errors name the key and the file: a parameter no file holds (missing), a
stored tensor the model has no place for (unexpected; a model's `_keys_to_ignore_on_load_unexpected`
patterns are honoured, as Hugging Face does), a shape or dtype that does not fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.weights.safetensors_folder import SafetensorsFolder, Stored, WeightsError

KeyMap = Callable[[str], str]


def _ignored(model: nn.Module, attr: str) -> list[re.Pattern[str]]:
    return [re.compile(p) for p in (getattr(model, attr, None) or [])]


class CheckpointWeights:
    """The stored tensor of every floating parameter and persistent buffer of `model`."""

    def __init__(
        self,
        folder: SafetensorsFolder,
        model: nn.Module,
        names: dict[int, list[str]] | None = None,
        shapes: dict[int, tuple[int, ...]] | None = None,
        key_map: KeyMap | None = None,
        buffers: list[tuple[str, torch.Tensor]] | None = None,
        read_early: set[str] | None = None,
    ) -> None:
        """`names`: id(param) -> candidate keys (default: the model's own names); `shapes`: id(param)
        -> true shape where the parameter object no longer shows it (a sharded placeholder);
        `buffers`: (key, tensor) of the persistent buffers (default: the model's own); `read_early`:
        keys already read into their parameters (from_pretrained's `prepare`), not unexpected ones."""
        self.folder = folder
        self._scratches: dict[str, torch.Tensor] = {}
        key_map = key_map or (lambda k: k)
        self.key_map = key_map
        if names is None:
            names = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
        self.of_param: dict[int, Stored] = {}
        used: set[str] = set(read_early or ())
        missing = []
        params = {id(p): p for p in model.parameters()}
        for pid, candidates in names.items():
            if pid not in params:
                continue
            keys = [key_map(n) for n in candidates]
            found = next((k for k in keys if k in folder), None)
            used.update(k for k in keys if k in folder)
            if found is None:
                missing.append(keys[0])
                continue
            stored = folder[found]
            shape = shapes.get(pid) if shapes else None
            self._check(stored, params[pid], tuple(shape) if shape is not None else tuple(params[pid].shape))
            self.of_param[pid] = stored
        self.buffers: list[tuple[torch.Tensor, Stored]] = []
        for name, b in persistent_buffers(model) if buffers is None else buffers:
            key = key_map(name)
            if key in folder:
                self._check(folder[key], b, tuple(b.shape))
                self.buffers.append((b, folder[key]))
                used.add(key)
        ignore_missing = _ignored(model, "_keys_to_ignore_on_load_missing")
        missing = [k for k in missing if not any(p.search(k) for p in ignore_missing)]
        if missing:
            raise WeightsError(
                f"{folder.path}: {len(missing)} parameters of the model are in no weights file, e.g. "
                f"{missing[:5]}; the folder does not hold this model's weights (or the names differ)"
            )
        ignore_unexpected = _ignored(model, "_keys_to_ignore_on_load_unexpected")
        unexpected = [
            k for k in folder if k not in used and not any(p.search(k) for p in ignore_unexpected)
        ]
        if unexpected:
            raise WeightsError(
                f"{folder.path}: {len(unexpected)} stored tensors have no place in the model, e.g. "
                f"{[(k, folder[k].path) for k in unexpected[:3]]}; load the matching architecture/config"
            )

    @staticmethod
    def _check(stored: Stored, target: torch.Tensor, shape: tuple[int, ...]) -> None:
        if stored.shape != shape:
            raise WeightsError(
                f"{stored.path}: tensor {stored.key!r} has shape {stored.shape}, the model's has {shape}"
            )
        if stored.dtype.is_floating_point != target.dtype.is_floating_point:
            raise WeightsError(
                f"{stored.path}: tensor {stored.key!r} is {stored.dtype}, the model's is {target.dtype}"
            )

    def stored(self, p: torch.Tensor) -> Stored | None:
        return self.of_param.get(id(p))

    def covers(self, params: Iterable[torch.Tensor]) -> bool:
        return any(id(p) in self.of_param for p in params)

    def read_range(
        self, layout: FlatLayout, params: Sequence[torch.Tensor], start: int, end: int, dtype: torch.dtype,
        scratch: bool = False,
    ) -> torch.Tensor:
        """Flat elements [start, end) of a unit (layout over `params`) in `dtype`, on the CPU: stored
        parameters read from their files (only these bytes), others taken from their own values,
        padding zero. `scratch`: into a buffer this object reuses, valid until the next such read
        (building a unit copies it away at once; a fresh buffer per unit would page-fault every byte)."""
        n = end - start
        out = self._scratch("out", n * dtype.itemsize).view(dtype) if scratch else torch.empty(n, dtype=dtype)
        pieces = layout.pieces(start, end)
        stored_of = [self.stored(params[piece.slot_index]) for piece in pieces]
        convert = sum(
            p.numel * st.dtype.itemsize for p, st in zip(pieces, stored_of, strict=True) if st and st.dtype != dtype
        )
        # stored pieces of another dtype land here first, each in its own range (reads run at once)
        converting = self._scratch("convert", convert) if scratch else torch.empty(convert, dtype=torch.uint8)
        pending, filled, used = [], start, 0
        for piece, stored in zip(pieces, stored_of, strict=True):
            out[filled - start : piece.start - start].zero_()  # padding between parameters
            filled = piece.end
            p = params[piece.slot_index]
            dst = out[piece.start - start : piece.end - start]
            if stored is None:
                dst.copy_(p.detach().reshape(-1)[piece.param_offset : piece.param_offset + piece.numel])
                continue
            if stored.dtype == dtype:
                buf = dst
            else:
                nbytes = piece.numel * stored.dtype.itemsize
                buf = converting[used : used + nbytes].view(stored.dtype)
                used += nbytes
            pending.append((self.folder.start_read(stored, piece.param_offset, buf), buf, dst))
        out[filled - start :].zero_()
        for handle, buf, dst in pending:
            handle.wait()
            if buf is not dst:
                dst.copy_(buf)  # the dtype conversion, rounding as `.to(dtype)` does
        return out

    def _scratch(self, kind: str, nbytes: int) -> torch.Tensor:
        """A reused byte buffer of at least `nbytes`, grown (never shrunk) as units need."""
        buf = self._scratches.get(kind)
        if buf is None or buf.numel() < nbytes:
            self._scratches[kind] = buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def release_scratch(self) -> None:
        """Drop the reused buffers (the model is built)."""
        self._scratches.clear()

    def load_buffers(self) -> None:
        """Copy the stored persistent buffers into the model's (every rank reads them whole)."""
        with torch.no_grad():
            for b, stored in self.buffers:
                b.copy_(self.folder.read(stored).to(b.dtype))


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state_dict name, buffer) of every persistent buffer, each buffer once."""
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{bname}" if mod_name else bname, b))
    return out


class UnitWeights:
    """`ShardedUnit`'s source of initial values: a unit's flat ranges from the checkpoint."""

    def __init__(self, weights: CheckpointWeights, params: Sequence[torch.Tensor]) -> None:
        self.weights, self.params = weights, params

    def read(
        self, layout: FlatLayout, start: int, end: int, dtype: torch.dtype, scratch: bool = False
    ) -> torch.Tensor:
        return self.weights.read_range(layout, self.params, start, end, dtype, scratch)
