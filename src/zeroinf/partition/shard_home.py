"""Where a stage-3 unit's compute-dtype parameter shard lives between uses: device, host or NVMe.

The unit asks its home to `start_load` the shard (asynchronous for NVMe: an O_DIRECT read of this
rank's slice only, into a buffer of a fixed pool; bandwidth-centric partitioning), then
`finish_load` for a tensor on the device that the all-gather takes as input, then `end_load` once
the gather has consumed it. After the optimizer step, `store` writes the new values (asynchronous
for NVMe; a later load of the same shard waits for that write first).

On an accelerator the host and NVMe homes copy the shard to the device on the owner's h2d stream
before the all-gather (runtime/streams.py), and wait for that copy before the host buffer is reused;
a device home receives updated values from a CPU optimizer the same way (`Transfers.upload`). On a
CPU device the host buffer is the all-gather input itself (host and device are the same memory).

[Note: writes from the master]
An updated fp32 shard equals the optimizer's fp32 master bit for bit, and a host optimizer keeps its
masters in place (ResidentStateStore). So `store(values, stable=True)` writes the file straight from
the master: no staging buffer, no copy. The master must not change while that write reads it; every
place that changes masters (the next step, the undo of a speculative step, loading a checkpoint or
weights, `zeroinf.gathered` writes) first calls `Transfers.wait_uploads()`, which the write joins
through `Transfers.reads_source`, as a CUDA upload from the same master does. The next load of the
shard waits for the write too, as for any write. The staging pool then needs no write buffer
(planner/unit_plan.py `param_writes_from_master`): one 4-byte-per-parameter buffer less of a
unit's size, and one copy of every shard less per step.

[Note: a shard kept for its masters]
Where the parameter file holds the optimizer's fp32 masters and the step runs inside backward
(optim/nvme_states.py [Note: masters in the parameter file]), the step needs each unit's shard again
right after the unit's backward gathered it. So a home's `end_load` keeps the staging buffer instead
of returning it (`NvmeParamFiles.keep`), and the step's master reads copy from it rather than read
the file again: 28 bytes per parameter a step instead of 32. A unit is stepped once its gradient
reduction is finished, and backward leaves up to `reductions_in_flight` reductions running (two
with several ranks, none in one CPU process), so the units gathered meanwhile must keep theirs too:
the most recently gathered `1 + reductions_in_flight` shards are kept, and keeping another gives the
oldest back, so the pool, planned that many buffers larger
(`ModelPlan.param_buffers_kept_for_masters`), never runs short for the prefetcher. With one buffer
at two ranks, 0.83 of every shard was read a third time (98M GPT, 2 ranks: 30.4 bytes per
parameter a step instead of 28). A store drops the unit's kept buffer (its values are then old); a
load of a kept shard takes it without reading (the last unit of forward is the first of backward).
Units the forward keeps gathered for the backward (runtime/prefetch.py `kept_for_backward`) are not
loaded in backward at all; beyond the shards still kept here, their steps read the masters from the
file: the bytes of the load they skipped.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from zeroinf.aio import AioEngine, AioHandle
from zeroinf.aio.buffers import PoolBuffer, SizedPools
from zeroinf.memory import Ledger, Tier
from zeroinf.runtime.streams import DeviceCopy, Landing, Transfers
from zeroinf.telemetry import phase
from zeroinf.tiers.host import host_zeros
from zeroinf.tiers.nvme import NvmeSwap
from zeroinf.tiers.shard_cache import ShardCache

PARAM_KIND = "param_shard"


class ShardHome(Protocol):
    tier: Tier

    def start_load(self) -> None: ...
    def finish_load(self) -> torch.Tensor: ...
    def end_load(self) -> None: ...
    def store(self, values: torch.Tensor, stable: bool = False) -> None: ...


class MemoryHome:
    """The shard stays in memory: on the device (ledger DEVICE) or on the host (ledger HOST)."""

    def __init__(
        self, initial: torch.Tensor, tier: Tier, device: torch.device, ledger: Ledger,
        transfers: Transfers | None = None, alias: bool = False,
    ) -> None:
        """`alias`: a resident unit's shard is its slice of the unit's whole buffer on the device,
        which never goes away; that slice is the shard (a copy would hold those bytes twice)."""
        self.tier, self.device, self.ledger = tier, device, ledger
        self.transfers = transfers or Transfers(device, ledger)
        if alias:
            if tier is not Tier.DEVICE or initial.device != device:
                raise ValueError(f"only a shard on the device ({device}) can alias, not one on {initial.device}")
            self.shard = initial
        elif tier is Tier.HOST:
            self.shard = host_zeros(initial.numel(), initial.dtype, ledger, "param_shard")
            self.shard.copy_(initial)
        else:
            self.shard = initial.to(device, copy=True)
            ledger.reserve(Tier.DEVICE, self.shard.numel() * self.shard.element_size(), "param_shard")
        self._copy: DeviceCopy | None = None  # the last copy of the host shard to the device
        self._incoming: Landing | None = None  # new values on their way from a device optimizer
        # The shard is the optimizer's fp32 master (`ShardedUnit.share_master`): the step updates it
        # in place and `store` of the master itself has nothing to do.
        self.holds_master = False

    def adopt_master(self, master: torch.Tensor) -> None:
        """Hold the fp32 `master` (in this shard's memory) as the shard: the shard itself when it is
        fp32 already, else in place of the compute-dtype one, which gathers then cast from (optim/
        states.py [Note: masters in the memory shard])."""
        if master.device != self.shard.device or master.numel() != self.shard.numel():
            raise ValueError(
                f"a master of {master.numel()} elements on {master.device} cannot replace a shard of "
                f"{self.shard.numel()} on {self.shard.device}"
            )
        if master is not self.shard:
            self.ledger.release(self.tier, self.shard.numel() * self.shard.element_size(), PARAM_KIND)
            self.ledger.reserve(self.tier, master.numel() * master.element_size(), PARAM_KIND)
        self.shard, self.holds_master = master, True

    def start_load(self) -> None:
        return None

    def finish_load(self) -> torch.Tensor:
        if self._copy is not None:
            self._copy.release()
        self._copy = self.transfers.to_device(self.shard, after=self._incoming)
        self._incoming = None
        return self._copy.tensor

    def end_load(self) -> None:
        # The copy is let go, not only released: kept until this unit's next load or step, a GPU kept
        # every host-homed unit's last device copy of its shard between forward and backward (the
        # whole model's compute-dtype shard, unseen by the ledger), and a CPU the compute-dtype shard
        # an fp32 master had replaced (`adopt_master`; 2 GiB for a 1.1B Llama built under zeroinf.init).
        # `store` still waits on it for the DMA's read of the old values.
        if self._copy is not None:
            self._copy.let_go()

    def store(self, values: torch.Tensor, stable: bool = False) -> None:
        if self.holds_master and values.data_ptr() == self.shard.data_ptr():
            return  # the optimizer stepped the shard itself
        if self.tier is not Tier.HOST:  # a device shard: from a CPU optimizer, asynchronously
            self.transfers.upload(values, self.shard)
            return
        if self._copy is not None:  # the last copy to the device must have read the old values
            self._copy.wait_source_free()
            self._copy = None
        if self._incoming is not None:  # an earlier store still landing must not overwrite this one
            self.transfers.retire(self._incoming)
            self._incoming = None
        if values.device.type == "cpu":
            self.shard.copy_(values)
        else:  # a device optimizer: the next load's copy is ordered after this one on the device
            private = values.to(self.shard.dtype, copy=True)  # the caller may change `values` meanwhile
            self._incoming = self.transfers.to_host(private, self.shard)


class NvmeParamFiles:
    """What every unit's NVMe home shares: the swap file, the aio engine, the staging pool, telemetry."""

    def __init__(
        self, swap: NvmeSwap, engine: AioEngine, pools: SizedPools, timeout_s: float, cache: ShardCache | None = None,
        keep: int = 0,
    ) -> None:
        self.swap, self.engine, self.pools, self.timeout_s = swap, engine, pools, timeout_s
        self.cache = cache  # host slots keeping shards between uses (offload.param_cache_bytes)
        # [Note: a shard kept for its masters]: up to `keep` units whose last gathered shard is kept
        # (oldest first), and their buffers.
        self.keep = keep
        self._kept: dict[str, PoolBuffer] = {}
        if cache is not None:
            cache.timeout_s, cache.waiter = timeout_s, self.wait
        self.pending_writes: deque[tuple[AioHandle, PoolBuffer]] = deque()
        # While the model is built, each unit is written once, unit after unit: one write in flight
        # overlaps reading the next unit, and the build touches two staging buffers, not the whole
        # pool (the engine lifts the bound once built). None: bounded by the pool only.
        self.max_pending_writes: int | None = None
        self.io_wait_s = 0.0  # time the training thread blocked on parameter I/O
        self.io_busy_s = 0.0  # time parameter requests were in flight (hidden or not)

    def reserve(self, nbytes: int) -> PoolBuffer:
        """A staging buffer for a shard of `nbytes` (of its size class: tiers/nvme_tier.py)."""
        # Writes return their buffer only when waited on: take back those already done first (the
        # pool lends its most recently used buffer, so a build that writes unit after unit touches
        # two buffers, not the whole pool), then wait the oldest before blocking on the pool.
        while self.pending_writes and self.pending_writes[0][0].done():
            self.retire_oldest_write()
        while self.pending_writes and (
            self.pools.free_count(nbytes) == 0
            or (self.max_pending_writes is not None and len(self.pending_writes) >= self.max_pending_writes)
        ):
            self.retire_oldest_write()
        return self.pools.reserve(nbytes, timeout_s=self.timeout_s)

    def keep_loaded(self, unit_name: str, buf: PoolBuffer) -> None:
        """Keep `buf`, holding `unit_name`'s shard; beyond `keep` buffers the oldest goes back."""
        self.drop_kept(unit_name)
        self._kept[unit_name] = buf
        while len(self._kept) > self.keep:
            self.pools.release(self._kept.pop(next(iter(self._kept))))

    def kept(self, unit_name: str) -> PoolBuffer | None:
        """The kept buffer holding `unit_name`'s shard, if any."""
        return self._kept.get(unit_name)

    def take_kept(self, unit_name: str) -> PoolBuffer | None:
        """The kept buffer of `unit_name`, handed to the caller (it is no longer kept)."""
        return self._kept.pop(unit_name, None)

    def drop_kept(self, unit_name: str | None = None) -> None:
        """Give kept buffers back to the pool: `unit_name`'s, or every one when None."""
        for name in list(self._kept) if unit_name is None else [unit_name]:
            buf = self._kept.pop(name, None)
            if buf is not None:
                self.pools.release(buf)

    def retire_oldest_write(self) -> None:
        # Waited before it leaves the queue: a wait that raises (an interrupt, an I/O error) keeps
        # the write and its buffer for the next retire, where popping first lost the buffer for good
        # (the pool ran dry a few writes later: BufferPoolTimeout).
        handle, buf = self.pending_writes[0]
        self.wait(handle)
        self.pending_writes.popleft()
        self.pools.release(buf)

    def drain(self) -> None:
        while self.pending_writes:
            self.retire_oldest_write()

    @phase("zeroinf::wait_io.params")
    def wait(self, handle: AioHandle) -> None:
        t0 = time.perf_counter()
        handle.wait(self.timeout_s)
        self.io_wait_s += time.perf_counter() - t0
        self.io_busy_s += handle.in_flight_s

    def close(self) -> None:
        """Finish the writes in flight, remove the swap file, stop the I/O threads (idempotent)."""
        try:
            self.drop_kept()
            self.drain()
        finally:
            if self.cache is not None:
                self.cache.close()
            self.swap.close()
            self.engine.close()
            if self.pools.all_free:  # a unit still holding its shard keeps the pools
                self.pools.close()


class NvmeHome:
    """The shard lives in this rank's parameter swap file; only this rank's slice is ever read."""

    tier = Tier.NVME

    def __init__(
        self, unit_name: str, initial: torch.Tensor, files: NvmeParamFiles, device: torch.device,
        transfers: Transfers | None = None,
    ) -> None:
        self.unit_name, self.files, self.device = unit_name, files, device
        self.transfers = transfers or Transfers(device, files.pools.ledger)
        self.numel, self.dtype = initial.numel(), initial.dtype
        self.nbytes = self.numel * self.dtype.itemsize  # what its staging buffer must hold
        self._loading: tuple[AioHandle, PoolBuffer] | None = None
        self._loaded: PoolBuffer | None = None
        self._copy: DeviceCopy | None = None
        self._write: AioHandle | None = None
        self._from_cache = False  # the loaded buffer is a cache slot, not a staging buffer
        self._write_from_slot = False
        self._write_direct = False  # the last write reads the optimizer's master itself
        if initial.device.type == "cpu" and initial.dtype == self.dtype and initial.is_contiguous() and (
            files.cache is None
        ):
            # Built on the CPU: written straight from the unit's buffer and waited for, so building
            # touches no staging buffer (each as large as the largest shard: a 1.1B Llama's 131 MB
            # embedding, which the build kept resident until training).
            files.wait(files.swap.swap_out(unit_name, PARAM_KIND, initial))
        else:
            self.store(initial)

    def _view(self, buf: PoolBuffer) -> torch.Tensor:
        return buf.tensor[: self.numel * self.dtype.itemsize].view(self.dtype)

    @phase("zeroinf::swap_in")
    def start_load(self) -> None:
        if self._loading is not None or self._loaded is not None:
            return
        cache = self.files.cache
        kept = self.files.take_kept(self.unit_name)
        if kept is not None:  # still current (a store drops it): no read
            if cache is not None:
                cache.policy.use(self.unit_name)  # the cache's clock follows every load
            self._loaded, self._from_cache = kept, False
            return
        if cache is not None:
            slot = cache.get(self.unit_name)
            if slot is not None:  # a hit: the slot holds the current values (writes update it too)
                self._loaded, self._from_cache = slot, True
                return
            slot = cache.admit(self.unit_name)
            if slot is not None:  # read straight into the slot it will stay in
                self._finish_own_write()
                handle = self.files.swap.swap_in(self.unit_name, PARAM_KIND, self._view(slot))
                self._loading, self._from_cache = (handle, slot), True
                return
        self._finish_own_write()
        buf = self.files.reserve(self.nbytes)
        handle = self.files.swap.swap_in(self.unit_name, PARAM_KIND, self._view(buf))
        self._loading, self._from_cache = (handle, buf), False

    def finish_load(self) -> torch.Tensor:
        self.start_load()
        self._land_loading()
        assert self._loaded is not None
        if self._copy is None:
            self._copy = self.transfers.to_device(self._view(self._loaded))
        return self._copy.tensor

    def end_load(self) -> None:
        if self._loaded is not None:
            if self._copy is not None:  # the host buffer is reused or evicted later: the DMA must be done
                self._copy.release()
                self._copy.wait_source_free()
                self._copy = None
            if self._from_cache:
                assert self.files.cache is not None
                self.files.cache.done(self.unit_name)
            elif self.files.keep:
                self.files.keep_loaded(self.unit_name, self._loaded)
            else:
                self.files.pools.release(self._loaded)
            self._loaded = None

    @phase("zeroinf::swap_out")
    def store(self, values: torch.Tensor, stable: bool = False) -> None:
        """Write the shard's new values. `stable`: `values` is an optimizer's host master, unchanged
        until `Transfers.wait_uploads()` (every site that changes masters waits there first), so an
        fp32 shard is written straight from it, without a staging copy ([Note: writes from the master])."""
        self._finish_own_write()
        self.files.drop_kept(self.unit_name)  # it holds the values before
        cache = self.files.cache
        slot = cache.slot(self.unit_name) if cache is not None else None
        if slot is not None:  # to the cache and the file together
            assert cache is not None
            self._land_loading()  # a read into the slot under way lands first
            self._fill(slot, values)
            self._write = self.files.swap.swap_out(self.unit_name, PARAM_KIND, self._view(slot))
            self._write_from_slot, self._write_direct = True, False
            cache.writing(self.unit_name, self._write)
            return
        if stable and values.device.type == "cpu" and values.dtype == self.dtype and values.is_contiguous():
            handle = self.files.swap.swap_out(self.unit_name, PARAM_KIND, values)
            self.transfers.reads_source(lambda: handle.wait(self.files.timeout_s))
            self._write, self._write_from_slot, self._write_direct = handle, False, True
            return
        buf = self.files.reserve(self.nbytes)
        self._fill(buf, values)
        handle = self.files.swap.swap_out(self.unit_name, PARAM_KIND, self._view(buf))
        self.files.pending_writes.append((handle, buf))
        self._write, self._write_from_slot, self._write_direct = handle, False, False

    # -- a range of the shard, for an optimizer whose masters are this file (optim/states.py) ----------
    def _land_loading(self) -> None:
        """A read of the shard under way lands now (its buffer then holds the current values)."""
        if self._loading is not None:
            handle, buf = self._loading
            self.files.wait(handle)
            self._loading, self._loaded = None, buf

    def _in_memory(self) -> PoolBuffer | None:
        """A host buffer holding the shard's current values: its cache slot, a buffer loaded for a
        gather, or the one kept after it."""
        self._land_loading()
        cache = self.files.cache
        slot = cache.slot(self.unit_name) if cache is not None else None
        if slot is not None:
            return slot
        return self._loaded if self._loaded is not None else self.files.kept(self.unit_name)

    def read_range(self, start: int, end: int, out: torch.Tensor) -> AioHandle | None:
        """Elements [start, end) of the shard into `out`: copied from memory when a host buffer holds
        the shard (None), else read from the file (the read's handle; the last write lands first)."""
        held = self._in_memory()
        if held is not None:
            out.copy_(self._view(held)[start:end])
            return None
        self._finish_own_write()
        return self.files.swap.swap_in(self.unit_name, PARAM_KIND, out, at_bytes=start * self.dtype.itemsize)

    def land_writes(self) -> None:
        """Wait for this shard's last write: the file then holds its current values."""
        self._finish_own_write()

    def read_file_range(self, start: int, end: int, out: torch.Tensor) -> None:
        """Elements [start, end) of the shard into `out` (contiguous, CPU), read from the file alone
        with a plain `pread`: neither the aio engine nor any host buffer of the shard is touched, so
        another thread may call it while training gathers this shard (a background checkpoint), as
        long as no write is in flight (`land_writes` first, and no `store` until it is done)."""
        slot = self.files.swap.slot_of(self.unit_name, PARAM_KIND)
        itemsize = self.dtype.itemsize
        nbytes = (end - start) * itemsize
        if not out.is_contiguous() or out.device.type != "cpu" or out.numel() * out.element_size() < nbytes:
            raise ValueError(f"read_file_range needs a contiguous CPU tensor of at least {nbytes} bytes")
        target = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B")  # no numpy needed
        fd = os.open(slot.path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [target[done:]], slot.offset_bytes + start * itemsize + done)
                if got <= 0:
                    raise OSError(f"short read of {slot.path!r}: {done} of {nbytes} bytes of unit {self.unit_name!r}")
                done += got
        finally:
            os.close(fd)

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None:
        """Replace elements [start, end) of the shard, in the file and in any host buffer holding it;
        returns once written."""
        self._finish_own_write()
        values = values.to("cpu", self.dtype).contiguous()
        held = self._in_memory()
        if held is not None:
            self._view(held)[start:end].copy_(values)
        at_bytes = start * self.dtype.itemsize
        self.files.wait(self.files.swap.swap_out(self.unit_name, PARAM_KIND, values, at_bytes=at_bytes))

    def _fill(self, buf: PoolBuffer, values: torch.Tensor) -> None:
        if values.device.type == "cpu":
            self._view(buf).copy_(values)
        else:  # a device optimizer: the write needs the values on the host now
            self.transfers.retire(self.transfers.to_host(values.to(self.dtype), self._view(buf)))

    def _finish_own_write(self) -> None:
        """A read of the shard must see the last write: retire writes up to and including ours."""
        if self._write is None:
            return
        if self._write_from_slot:
            assert self.files.cache is not None
            self.files.cache.wait_write(self.unit_name)
        if self._write_direct:
            self.files.wait(self._write)
        while self.files.pending_writes and not self._write_retired():
            self.files.retire_oldest_write()
        self._write = None

    def _write_retired(self) -> bool:
        return all(handle is not self._write for handle, _ in self.files.pending_writes)


GRAD_KIND = "grad_shard"
MAX_GRAD_WRITES_IN_FLIGHT = 2


class NvmeGradFiles:
    """fp32 gradient shards of every unit in this rank's gradient swap file.

    A unit's reduced shard is written as soon as its reduce-scatter finishes (added to what an
    earlier micro-step wrote, read back first); at most two writes are in flight, each holding
    its unit's shard until the disk has it. The optimizer reads one unit's shard at a time, so
    host memory for gradients is a couple of unit shards whatever the model size.
    """

    def __init__(self, swap: NvmeSwap, timeout_s: float) -> None:
        self.swap, self.timeout_s = swap, timeout_s
        self._writes: deque[tuple[AioHandle, torch.Tensor, Callable[[], None] | None]] = deque()
        self.io_wait_s = 0.0
        self.io_busy_s = 0.0

    @phase("zeroinf::wait_io.grads")
    def _wait(self, handle: AioHandle) -> None:
        t0 = time.perf_counter()
        handle.wait(self.timeout_s)
        self.io_wait_s += time.perf_counter() - t0
        self.io_busy_s += handle.in_flight_s

    def _retire_oldest(self) -> None:
        handle, _, on_written = self._writes[0]
        self._wait(handle)  # before it leaves the queue (see `NvmeParamFiles.retire_oldest_write`)
        self._writes.popleft()
        if on_written is not None:
            on_written()

    def drain(self) -> None:
        while self._writes:
            self._retire_oldest()

    @phase("zeroinf::swap_out")
    def write(self, unit_name: str, shard: torch.Tensor, on_written: Callable[[], None] | None = None) -> None:
        """Start writing `shard` (host memory, untouched until written); `on_written()` runs then."""
        if shard.device.type != "cpu":
            raise ValueError(f"gradient shard of {unit_name} is on {shard.device}: land it on the host first")
        while len(self._writes) >= MAX_GRAD_WRITES_IN_FLIGHT:
            self._retire_oldest()
        self._writes.append((self.swap.swap_out(unit_name, GRAD_KIND, shard), shard, on_written))

    @phase("zeroinf::swap_in")
    def read(self, unit_name: str, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read a unit's shard into `out` (fp32, `numel`; a fresh tensor if None)."""
        self.drain()  # a read must see every write before it
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        self._wait(self.swap.swap_in(unit_name, GRAD_KIND, out))
        return out

    def close(self) -> None:
        """Finish the writes in flight, remove the swap file, stop the I/O threads (idempotent)."""
        try:
            self.drain()
        finally:
            self.swap.close()
            self.swap.engine.close()
