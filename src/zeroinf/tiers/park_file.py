"""The NVMe park: this rank's slices of parameters parked by `zeroinf.init()`, in one swap file.

A `ParkStore` (partition/park.py) on the nvme tier. Slots are appended as parameters are parked
(`NvmeSwap.add_slot`: the file grows, preallocated, so a full disk fails at the parking that does
not fit) and reused when the same parameter is parked again. Writes are asynchronous: the slice is
converted into one of a few fixed 16 MiB staging buffers, chunk by chunk, and written from there,
so parking a parameter never makes a slice-sized copy (a 262 MB fp32 embedding is parked with
64 MiB of buffers). Unparking at world 1 reads back the same way (`take_into`), straight into the
parameter's new storage or its unit's flat buffer. The file (`zeroinf-rank<r>-park.swap`)
is removed when the park closes: after `zeroinf.shard` has built every unit, or at exit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import torch

from zeroinf.aio import AioConfig, AioHandle, aligned_empty
from zeroinf.tiers.nvme import ModelIndex, NvmeSwap, open_engine, plan_swap_layout

PARK_KIND = "park"
CHUNK_BYTES = 16 * 2**20
STAGING_BUFFERS = 4  # writes in flight, each from its own chunk buffer: construction holds 64 MiB of them
READING_BUFFERS = 2  # once built, the slices are read back unit by unit: one read ahead of the conversion


class NvmeParkStore:
    def __init__(self, folder: str, rank: int, timeout_s: float, aio: AioConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.engine = open_engine(aio)
        # Several builds may park in one folder at once (tiers/nvme.py [Note: several sharded models ...]).
        self.model = ModelIndex(folder, rank, "park")
        try:
            self.swap = NvmeSwap(plan_swap_layout({}, folder, rank, model=self.model.index), self.engine)
        except BaseException:
            self.engine.close()
            self.model.release()
            raise
        self._slots: dict[int, tuple[str, torch.dtype, int]] = {}  # key -> (slot name, dtype, numel)
        self._staging = [aligned_empty(CHUNK_BYTES) for _ in range(STAGING_BUFFERS)]
        self._writes: deque[tuple[AioHandle, int, int]] = deque()  # (handle, staging buffer, key)
        self.io_wait_s = 0.0

    def _wait(self, handle: AioHandle) -> None:
        t0 = time.perf_counter()
        handle.wait(self.timeout_s)
        self.io_wait_s += time.perf_counter() - t0

    def _free_buffer(self) -> int:
        busy = {b for _, b, _ in self._writes}
        free = next((b for b in range(len(self._staging)) if b not in busy), None)
        if free is not None:
            return free
        handle, buffer, _ = self._writes.popleft()
        self._wait(handle)
        return buffer

    def _drain(self, key: int | None = None) -> None:
        """Wait for the writes of `key` (all writes when None): a read must see them."""
        while any(key is None or k == key for _, _, k in self._writes):
            self._wait(self._writes.popleft()[0])

    def put(self, key: int, values: torch.Tensor, numel: int, dtype: torch.dtype) -> None:
        """Convert and write `values` chunk by chunk through the staging buffers (no slice-sized copy)."""
        self.put_pieces(key, [values.detach().reshape(-1)], numel, dtype)

    def put_pieces(self, key: int, pieces: Iterable[torch.Tensor], numel: int, dtype: torch.dtype) -> None:
        """`put` of values that arrive as consecutive flat pieces (drawn one at a time: park.py
        [Note: a large parameter drawn in pieces]); every piece is consumed, in order."""
        self._drain(key)  # the slot is about to be rewritten: its older writes land first
        slot = self._slots.get(key)
        if slot is None or slot[1:] != (dtype, numel):
            name = f"p{key}.{len(self._slots)}"
            self.swap.add_slot(name, PARK_KIND, numel * dtype.itemsize)
            slot = self._slots[key] = (name, dtype, numel)
        per_chunk = CHUNK_BYTES // dtype.itemsize
        at = filled = 0  # elements of the slot written, and staged in `buffer` since
        buffer = -1

        def write() -> None:
            staged = self._staging[buffer][: filled * dtype.itemsize].view(dtype)
            handle = self.swap.swap_out(slot[0], PARK_KIND, staged, at_bytes=at * dtype.itemsize)
            self._writes.append((handle, buffer, key))

        for flat in pieces:  # staged whole chunks: every write but the last starts and ends aligned
            start = 0
            while start < flat.numel():
                if buffer < 0:
                    buffer, filled = self._free_buffer(), 0
                take = min(per_chunk - filled, flat.numel() - start)
                self._staging[buffer][filled * dtype.itemsize : (filled + take) * dtype.itemsize].view(dtype).copy_(
                    flat[start : start + take]
                )
                start, filled = start + take, filled + take
                if filled == per_chunk:
                    write()
                    at, buffer = at + filled, -1
        if buffer >= 0 and filled:
            write()
        # the padding after the values is never read back as data (unparking cuts it off)

    def take(self, key: int, device: torch.device) -> torch.Tensor:
        _, dtype, numel = self._slots[key]
        out = torch.empty(numel, dtype=dtype)
        self.take_into(key, out)
        return out.to(device)

    def take_into(self, key: int, out: torch.Tensor, keep: bool = False) -> None:
        """Read the slice's first `out.numel()` elements into `out` (contiguous, CPU; converted to its
        dtype chunk by chunk through the staging buffers): no slice-sized temporary, so unparking a
        262 MB fp32 head holds the head and 64 MiB, not also its 131 MB bf16 slice. In the slot's own
        dtype the read goes straight into `out`. A slot stays in the file until `discard` (`keep` is
        the only way here)."""
        name, dtype, numel = self._slots[key]
        flat = out.view(-1)
        if flat.numel() > numel:
            raise ValueError(f"park slot {key} holds {numel} elements, asked for {flat.numel()}")
        if flat.dtype == dtype and flat.device.type == "cpu":
            self._drain(key)
            self._wait(self.swap.swap_in(name, PARK_KIND, flat, at_bytes=0))
            return
        self._drain()  # the staging buffers carry the reads now: every write from them has landed
        per_chunk = CHUNK_BYTES // dtype.itemsize
        starts = list(range(0, flat.numel(), per_chunk))
        reads: deque[tuple[AioHandle, torch.Tensor, int]] = deque()

        def start_read(i: int) -> None:
            start = starts[i]
            staged = self._staging[i % len(self._staging)][: min(per_chunk, flat.numel() - start) * dtype.itemsize]
            staged_values = staged.view(dtype)
            reads.append((self.swap.swap_in(name, PARK_KIND, staged_values, at_bytes=start * dtype.itemsize),
                          staged_values, start))

        for i in range(min(len(self._staging), len(starts))):
            start_read(i)
        for i in range(len(starts)):
            handle, staged_values, start = reads.popleft()
            self._wait(handle)
            flat[start : start + staged_values.numel()].copy_(staged_values)
            if i + len(self._staging) < len(starts):  # the buffer just emptied carries the next read
                start_read(i + len(self._staging))

    def discard(self, key: int) -> None:
        """Forget a slot: its key is never read again (the file keeps its room until the park closes)."""
        self._drain(key)
        self._slots.pop(key, None)

    def reading_only(self) -> None:
        """The build is over: keep READING_BUFFERS staging buffers and free the rest (16 MiB each),
        which `shard` would otherwise hold beside the unit it builds (1.1B Llama: 217 -> 183 MB of
        peak RSS). Later writes (an edit in `gathered` before `shard`) use the ones kept."""
        self._drain()
        del self._staging[READING_BUFFERS:]

    @property
    def bytes_written(self) -> int:
        return self.engine.stats().bytes_written

    def close(self) -> None:
        for handle, _, _ in self._writes:
            handle.wait_done()
        self._writes.clear()
        self.swap.close()
        self.engine.close()
        self.model.release()
