"""Reading a checkpoint's saved chunks back: any element range of any parameter, checksummed."""

from __future__ import annotations

import bisect
from concurrent.futures import Executor, Future
from typing import Any

import torch

from zeroinf.checkpoint.format import CHUNK_NUMEL, MANIFEST, CheckpointError, DataFiles, chunk_what


class ChunkReader:
    """Reads the saved chunks of parameter ranges, verified, keeping the last partly used chunk.

    With an `executor`, whole chunks that land straight in their targets are read (and their
    checksums checked) on its threads, several at once, while the caller plans the next ones;
    `drain()` waits for them and raises the first error. Only chunks cut by a reshard go through
    the reader's own buffers, synchronously.
    """

    def __init__(
        self, body: dict[str, Any], data: DataFiles, kinds: int = 3, executor: Executor | None = None
    ) -> None:
        self.chunks, self.data, self.kinds, self.executor = body["chunks"], data, kinds, executor
        self._pending: list[Future[None]] = []
        self._starts = {name: [c["o"] for c in lst] for name, lst in self.chunks.items()}
        self._cached: tuple[tuple[str, int], list[torch.Tensor]] | None = None
        self._bufs: list[torch.Tensor] | None = None

    def _read(self, pname: str, chunk: dict[str, Any]) -> list[torch.Tensor]:
        key = (chunk["f"], chunk["b"])
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        n = chunk["n"]
        if self._bufs is None or self._bufs[0].numel() < n:  # reused: no allocation per chunk
            self._bufs = [torch.empty(max(n, CHUNK_NUMEL), dtype=torch.float32) for _ in range(self.kinds)]
        self._cached = None
        out = []
        for k in range(self.kinds):
            t = self._bufs[k][:n]
            self.data.read_into(chunk["f"], chunk["b"] + 4 * n * k, t, chunk["h"][k], chunk_what(k, pname, chunk))
            out.append(t)
        self._cached = (key, out)
        return out

    def _read_direct(self, pname: str, chunk: dict[str, Any], targets: list[torch.Tensor]) -> None:
        n = chunk["n"]
        for k, t in enumerate(targets):
            args = (chunk["f"], chunk["b"] + 4 * n * k, t, chunk["h"][k], chunk_what(k, pname, chunk))
            if self.executor is None:
                self.data.read_into(*args)
            else:
                self._pending.append(self.executor.submit(self.data.read_into, *args))

    def drain(self, *, raise_errors: bool = True) -> None:
        """Wait for every read in flight (so no target is reused while a read fills it); then raise."""
        pending, self._pending = self._pending, []
        first: BaseException | None = None
        for f in pending:
            error = f.exception()
            first = first or error
        if first is not None and raise_errors:
            raise first

    def fill(self, pname: str, a: int, b: int, targets: list[torch.Tensor]) -> None:
        """targets[k][0 : b - a] <- state k of parameter elements [a, b)."""
        lst = self.chunks.get(pname)
        if not lst:
            raise CheckpointError(f"{self.data.dir}: the manifest has no data for parameter {pname}")
        i = max(0, bisect.bisect_right(self._starts[pname], a) - 1)
        pos = a
        while pos < b:
            if i >= len(lst) or lst[i]["o"] > pos or lst[i]["o"] + lst[i]["n"] <= pos:
                raise CheckpointError(
                    f"{self.data.dir}/{MANIFEST}: parameter {pname} elements from {pos} are in no saved chunk "
                    "(the checkpoint is incomplete)"
                )
            c = lst[i]
            hi = min(b, c["o"] + c["n"])
            if pos == c["o"] and hi == c["o"] + c["n"] and all(t.is_contiguous() and t.device.type == "cpu"
                                                                  for t in targets):
                self._read_direct(pname, c, [t[pos - a : hi - a] for t in targets])  # no staging copy
                pos = hi
                i += 1
                continue
            states = self._read(pname, c)
            for dst, src in zip(targets, states, strict=False):
                dst[pos - a : hi - a].copy_(src[pos - c["o"] : hi - c["o"]])
            pos = hi
            i += 1
