"""The NVMe park: this rank's slices of parameters parked by `zeroinf.init()`, in one swap file.

A `ParkStore` (partition/park.py) on the nvme tier. Slots are appended as parameters are parked
(`NvmeSwap.add_slot`: the file grows, preallocated, so a full disk fails at the parking that does
not fit) and reused when the same parameter is parked again. Writes are asynchronous: the slice is
copied into a CPU buffer owned by the write until the disk has it, and a `take` of a slice whose
write is still in flight returns that buffer without reading. The file (`zeroinf-rank<r>-park.swap`)
is removed when the park closes: after `zeroinf.shard` has built every unit, or at exit.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from zeroinf.aio import AioConfig, AioEngine, AioHandle
from zeroinf.tiers.nvme import NvmeSwap, plan_swap_layout

PARK_KIND = "park"
MAX_WRITES_IN_FLIGHT = 8


class NvmeParkStore:
    def __init__(self, folder: str, rank: int, timeout_s: float, aio: AioConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.engine = AioEngine(aio or AioConfig())
        try:
            self.swap = NvmeSwap(plan_swap_layout({}, folder, rank), self.engine)
        except BaseException:
            self.engine.close()
            raise
        self._slots: dict[int, tuple[str, torch.dtype, int]] = {}  # key -> (slot name, dtype, numel)
        self._writes: OrderedDict[int, tuple[AioHandle, torch.Tensor]] = OrderedDict()
        self.io_wait_s = 0.0

    def _wait(self, handle: AioHandle) -> None:
        t0 = time.perf_counter()
        handle.wait(self.timeout_s)
        self.io_wait_s += time.perf_counter() - t0

    def put(self, key: int, values: torch.Tensor) -> None:
        if key in self._writes:  # the slot is about to be rewritten: the older write must land first
            self._wait(self._writes.pop(key)[0])
        buffer = values.detach().to("cpu").contiguous()  # ours (put takes ownership): held until written
        slot = self._slots.get(key)
        if slot is None or slot[1:] != (buffer.dtype, buffer.numel()):
            name = f"p{key}.{len(self._slots)}"
            self.swap.add_slot(name, PARK_KIND, buffer.numel() * buffer.element_size())
            slot = self._slots[key] = (name, buffer.dtype, buffer.numel())
        self._writes[key] = (self.swap.swap_out(slot[0], PARK_KIND, buffer), buffer)
        while len(self._writes) > MAX_WRITES_IN_FLIGHT:
            self._wait(self._writes.popitem(last=False)[1][0])

    def take(self, key: int, device: torch.device) -> torch.Tensor:
        pending = self._writes.pop(key, None)
        if pending is not None:  # still in memory: no need to read it back
            self._wait(pending[0])
            return pending[1].to(device)
        name, dtype, numel = self._slots[key]
        out = torch.empty(numel, dtype=dtype)
        self._wait(self.swap.swap_in(name, PARK_KIND, out))
        return out.to(device)

    @property
    def bytes_written(self) -> int:
        return self.engine.stats().bytes_written

    def close(self) -> None:
        for handle, _ in self._writes.values():
            handle.wait_done()
        self._writes.clear()
        self.swap.close()
        self.engine.close()
