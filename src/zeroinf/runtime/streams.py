"""`Transfers`: the one owner of host<->device movement: copy streams, events, pinned staging, counters.

Every byte the engine moves between host memory and the accelerator goes through one `Transfers`
object per engine: parameter shards coming in for a gather (`to_device`), reduced gradient shards
going out (`land`), updated parameters going back after a CPU optimizer step (`upload`), gradients
fetched by a CPU optimizer (`to_host`), and the activations kept by checkpointing (`to_host` /
`to_device` with buffers from `HostPool`). Nothing else in the package creates a stream, an event
or a pinned buffer for a transfer.

[Note: the two copy streams]
On an accelerator (CUDA, or any device with torch.Stream/torch.Event; only accelerator-neutral
APIs are used) the object owns two streams beside the compute stream:
- `h2d` (host to device): parameter shards for the next gathers, updated parameters, activations
  coming back. On the compute stream such a copy would wait behind the kernels queued for the
  current unit; on its own stream it runs beside them.
- `d2h` (device to host): reduced gradient shards and activations leaving the device. A reduced
  gradient can leave as soon as its reduce-scatter is done, while the rest of backward computes.
Ordering is by events only: a copy that reads what the compute stream produced waits on an event
recorded on the compute stream at issue time; the compute stream waits on the copy's event before
anything that uses its result. The CPU never waits for a copy when it issues it: it waits (on the
copy's event) only where it reads the host result itself (adding a gradient, a CPU Adam step), or
before it overwrites or reuses a host buffer a copy may still read.

[Note: pinned staging, allocated once]
An asynchronous copy needs page-locked host memory on both ends that nobody touches until the copy's
event has completed. Persistent host shards (tiers/host.py `host_zeros`) are pinned when CUDA is
present. Temporary host buffers (an accumulating micro-step's gradient before it is added, an
activation kept by checkpointing) come from `HostPool`: pinned buffers kept by size and reused, so
the first step allocates them and a steady step allocates none. Each buffer goes back to the pool
with the event of the last copy that reads it and is handed out again only after that event.

[Note: a CPU-only machine]
When the device is the CPU, host and device are the same memory: `to_device` returns its source,
`land`, `to_host` and `upload` copy (or add) at once, and no stream or event exists. The same calls
run, so the CPU tests exercise every branch except the few marked "accelerator branch".

Counters (`stats`, per step and in total): bytes and copies per direction that crossed between
host memory and the accelerator (none on a CPU device, where nothing crosses), copies from or into
pageable host memory (each is a hidden synchronization; zero in a correct steady step), CPU waits
that found a copy unfinished (`stalls`), and pool buffers allocated (`staging_allocations`; zero in
a steady step, on every device).

Outside the step, construction (`_build_from_source`, parked parameters), weight loading, and
checkpoints move bytes with plain copies: they run once, from pageable memory the caller owns.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zeroinf.memory import Ledger, Tier

STAGING_TAG = "transfer_staging"  # host ledger tag of the pool's buffers
DEVICE_STAGING_TAG = "transfer_device"  # device ledger tag of copies in flight to the device
MAX_PENDING_LANDINGS = 4  # gradient shards on their way to the host before the CPU waits for the oldest


class TransferStats:
    """Counters of one `Transfers`: `this_step`, `last_step` (the previous step's) and `total`."""

    KEYS = (
        "h2d_bytes", "d2h_bytes", "h2d_copies", "d2h_copies",
        "pageable_copies", "stalls", "staging_allocations",
    )

    def __init__(self) -> None:
        self.this_step: Counter[str] = Counter()
        self.last_step: Counter[str] = Counter()
        self.total: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        self.this_step[key] += n
        self.total[key] += n

    def end_step(self) -> None:
        self.last_step, self.this_step = self.this_step, Counter()

    def report(self) -> dict[str, dict[str, int]]:
        return {
            "last_step": {k: self.last_step.get(k, 0) for k in self.KEYS},
            "total": {k: self.total.get(k, 0) for k in self.KEYS},
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class DeviceCopy:
    """A tensor on its way to the device: `tensor` is usable on the compute stream at once.

    `done` (accelerator only) completes when the copy has read its host source; `wait_source_free`
    must return before that source is overwritten or reused. Idempotent."""

    tensor: torch.Tensor
    done: torch.Event | None = None
    owner: Transfers | None = None
    device_bytes: int = 0  # device memory of the copy, on the ledger until `release`

    def wait_source_free(self) -> None:
        if self.done is not None:
            assert self.owner is not None
            self.owner.wait_event(self.done)
            self.done = None

    def release(self) -> None:
        """The consumer has queued its last use of `tensor`: the ledger forgets its device bytes (the
        allocator frees them once the compute stream is done). Does not wait for anything."""
        if self.device_bytes and self.owner is not None:
            self.owner.ledger.release(Tier.DEVICE, self.device_bytes, DEVICE_STAGING_TAG)
            self.device_bytes = 0

    def let_go(self) -> None:
        """`release`, and drop this object's reference to `tensor` (its queued uses keep its memory
        through the stream records), so the memory is freed as the ledger says; `wait_source_free`
        still works. Reading `tensor` afterwards is an error."""
        self.release()
        self.__dict__.pop("tensor", None)


@dataclass
class Landing:
    """A device tensor on its way into host memory; `then` runs on the CPU once it has arrived.

    Landings retire in the order they were issued (`Transfers.retire`), so two additions into the
    same host shard happen in micro-step order, whatever order they are waited in."""

    done: torch.Event | None
    then: Callable[[], None] | None = None
    retired: bool = False
    queued: bool = False  # in the owner's FIFO (it has a CPU part to run)


@dataclass
class _PooledBuffer:
    tensor: torch.Tensor
    free_after: torch.Event | None = None


@dataclass
class HostPool:
    """Pinned (when CUDA is present) host buffers by byte size, reused across steps.

    `acquire(nbytes)` returns a free buffer of exactly that size (a steady step asks for the same
    sizes as the step before), allocating only when none is free; `release(buf, after)` returns it
    once the event `after` (the last copy reading or writing it) has completed. Bytes held are on
    the ledger's host tier under `STAGING_TAG`."""

    owner: Transfers
    pin: bool
    _free: dict[int, deque[_PooledBuffer]] = field(default_factory=dict)
    held_bytes: int = 0

    def acquire(self, nbytes: int, tag: str = STAGING_TAG) -> torch.Tensor:
        """A buffer of `nbytes`; while lent, its bytes are on the ledger under `tag`."""
        ledger = self.owner.ledger
        free = self._free.get(nbytes)
        if free:
            buf = free.popleft()
            if buf.free_after is not None:
                self.owner.wait_event(buf.free_after)
            ledger.release(Tier.HOST, nbytes, STAGING_TAG)
            ledger.reserve(Tier.HOST, nbytes, tag)
            return buf.tensor
        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)[:nbytes]
        ledger.reserve(Tier.HOST, nbytes, tag)
        self.owner.stats.add("staging_allocations")
        self.held_bytes += nbytes
        return tensor

    def release(self, tensor: torch.Tensor, after: torch.Event | None = None, tag: str = STAGING_TAG) -> None:
        """Take back a buffer from `acquire`; lent again only once `after` has completed."""
        nbytes = tensor.numel()
        self.owner.ledger.release(Tier.HOST, nbytes, tag)
        self.owner.ledger.reserve(Tier.HOST, nbytes, STAGING_TAG)
        self._free.setdefault(nbytes, deque()).append(_PooledBuffer(tensor, after))

    @property
    def free_count(self) -> int:
        return sum(len(free) for free in self._free.values())

    def clear(self) -> None:
        """Free every buffer in the pool (all must have been released)."""
        freed = 0
        for free in self._free.values():
            for buf in free:
                if buf.free_after is not None:
                    buf.free_after.synchronize()
                freed += buf.tensor.numel()
        if freed:
            self.owner.ledger.release(Tier.HOST, freed, STAGING_TAG)
        self.held_bytes -= freed
        self._free.clear()


def typed_view(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`buffer` (uint8, exactly `like`'s bytes) seen with `like`'s dtype and shape, contiguous."""
    return buffer.view(like.dtype).view(like.shape) if like.numel() else buffer[:0].view(like.dtype).view(like.shape)


class Transfers:
    """Owns the copy streams, their events, the pinned pool and the counters of one engine's device."""

    def __init__(self, device: torch.device, ledger: Ledger) -> None:
        self.device, self.ledger = device, ledger
        self.accelerated = device.type != "cpu"
        self.stats = TransferStats()
        self.h2d: torch.Stream | None = None  # see [Note: the two copy streams]
        self.d2h: torch.Stream | None = None
        if self.accelerated:  # accelerator branch
            self.h2d = torch.Stream(device=device)
            self.d2h = torch.Stream(device=device)
        self.pool = HostPool(self, pin=self.accelerated and torch.cuda.is_available())
        self._landings: deque[Landing] = deque()  # issued, not yet retired, oldest first
        self._upload_sources: list[torch.Event] = []  # uploads whose host source may still be read
        self._unordered_uploads: list[torch.Event] = []  # uploads the compute stream does not wait for yet
        self._source_readers: list[Callable[[], object]] = []  # other readers of masters (NVMe writes): waits

    # -- events -----------------------------------------------------------------------------------
    def _compute_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def _record(self, stream: torch.Stream) -> torch.Event:
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def wait_event(self, event: torch.Event) -> None:
        """Block the CPU until `event` completed, counting it as a stall if it had not yet."""
        if not event.query():
            self.stats.add("stalls")
            event.synchronize()

    def _count(self, direction: str, host: torch.Tensor) -> None:
        self.stats.add(f"{direction}_copies")
        self.stats.add(f"{direction}_bytes", _nbytes(host))
        if self.accelerated and host.device.type == "cpu" and not host.is_pinned():
            self.stats.add("pageable_copies")

    # -- host to device ---------------------------------------------------------------------------
    def to_device(self, host: torch.Tensor, after: Landing | None = None) -> DeviceCopy:
        """Start copying `host` to the device; the result is usable on the compute stream at once.
        `after`: a landing that writes `host` and must finish first (ordered on the device, the CPU
        does not wait). CPU device: `host` itself, nothing copied."""
        if host.device == self.device:
            return DeviceCopy(host)
        self._count("h2d", host)
        # accelerator branch: the fresh tensor comes from the h2d stream's pool, so no compute-stream
        # work can still be using its memory; the compute stream waits for the copy, and the tensor
        # is marked as used there so the allocator keeps it until the compute stream is done.
        assert self.h2d is not None
        compute = self._compute_stream()
        if after is not None and after.done is not None:
            self.h2d.wait_event(after.done)
        with self.h2d:
            tensor = host.to(self.device, non_blocking=True)
        done = self._record(self.h2d)
        compute.wait_event(done)
        tensor.record_stream(compute)
        self.ledger.reserve(Tier.DEVICE, _nbytes(tensor), DEVICE_STAGING_TAG)
        return DeviceCopy(tensor, done, self, _nbytes(tensor))

    def upload(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write `values` (any dtype, host or device) into the device tensor `out` (updated
        parameters after an optimizer step); `order_uploads()` orders it before the compute
        stream's next kernels (see [Note: uploads are ordered before the next reader, not at once]).

        From the host: the bytes cross in `values`' dtype into a device temporary on the h2d stream
        (after the compute stream's queued work, which may still read `out`), then are cast into
        `out` there. `values` must not change until `wait_uploads()` returned."""
        if values.device == out.device:  # device optimizer, or the CPU: a plain (casting) copy
            out.copy_(values)
            return
        self._count("h2d", values)
        # accelerator branch
        assert self.h2d is not None
        compute = self._compute_stream()
        self.h2d.wait_event(self._record(compute))
        with self.h2d:
            if values.dtype == out.dtype:
                out.copy_(values, non_blocking=True)
            else:  # torch would cast on the CPU into a fresh pageable tensor: cast on the device instead
                landed = torch.empty(values.shape, dtype=values.dtype, device=self.device)
                landed.copy_(values, non_blocking=True)
                out.copy_(landed)
        done = self._record(self.h2d)
        self._unordered_uploads.append(done)
        self._upload_sources.append(done)

    # [Note: uploads are ordered before the next reader, not at once]
    # An optimizer stepping inside backward uploads each unit's new parameters while the backward
    # kernels of the other units are still being queued. Had the compute stream waited for each
    # upload as it was issued, those kernels (which never read that unit's parameters: its gradients
    # are complete) would wait behind every copy, and the copies behind them: compute and copies in
    # series. The wait is issued where something reads the parameters next instead: a unit's
    # gather (`ShardedUnit.start_unshard`), the all-gather of an updated shard, the start of the
    # next forward, and the end of the step (`Engine.end_step`), before anything after it.
    def order_uploads(self) -> None:
        """Make the compute stream wait for every upload issued so far (no CPU wait)."""
        if not self._unordered_uploads:
            return
        compute = self._compute_stream()
        for event in self._unordered_uploads:
            compute.wait_event(event)
        self._unordered_uploads.clear()

    def reads_source(self, wait: Callable[[], object]) -> None:
        """Something else reads an optimizer's master in the background (the NVMe write of an updated
        shard, straight from the master): `wait_uploads()` calls `wait` too, so every place that
        changes masters after waiting for uploads also waits for it."""
        self._source_readers.append(wait)

    def wait_uploads(self) -> None:
        """Block until every `upload` (and every `reads_source` reader) has read its host source
        (before those values change)."""
        for event in self._upload_sources:
            self.wait_event(event)
        self._upload_sources.clear()
        readers, self._source_readers = self._source_readers, []
        for wait in readers:
            wait()

    # -- device to host ---------------------------------------------------------------------------
    def to_host(self, source: torch.Tensor, out: torch.Tensor) -> Landing:
        """Start copying the device tensor `source` into the host tensor `out` (same shape; pinned
        on an accelerator). `retire(landing)` before reading `out`. CPU device: copied at once."""
        return self.land(source, out, accumulate=False)

    def land(
        self,
        source: torch.Tensor,
        target: torch.Tensor,
        accumulate: bool,
        then: Callable[[], None] | None = None,
    ) -> Landing:
        """Bring the device tensor `source` into the host tensor `target`: copied over it, or added
        to it (`accumulate`), then `then()` runs on the CPU. Asynchronous on an accelerator: the
        copy starts on the d2h stream once the compute stream's queued work (which produced
        `source`) is done, and the CPU adds and runs `then` when the landing retires."""
        if not self.accelerated or source.device.type == "cpu":
            if accumulate:
                target.add_(source)
            elif source.data_ptr() != target.data_ptr():
                target.copy_(source)
            if then is not None:
                then()
            return Landing(None, retired=True)
        # accelerator branch
        assert self.d2h is not None
        self.d2h.wait_event(self._record(self._compute_stream()))
        raw = self.pool.acquire(_nbytes(source)) if accumulate else None
        staging = typed_view(raw, source) if raw is not None else target
        self._count("d2h", staging)
        with self.d2h:
            staging.copy_(source, non_blocking=True)
        source.record_stream(self.d2h)  # the allocator must not reuse its memory before the copy read it
        done = self._record(self.d2h)
        if raw is None and then is None:  # nothing for the CPU to do: the caller waits when it reads
            return Landing(done)

        def arrived() -> None:
            if raw is not None:
                target.add_(staging)
                self.pool.release(raw)
            if then is not None:
                then()

        landing = Landing(done, arrived, queued=True)
        self._landings.append(landing)
        self._retire_ready()
        return landing

    def _retire_ready(self) -> None:
        """Retire finished landings (oldest first), and wait for the oldest beyond the cap."""
        while self._landings:
            oldest = self._landings[0].done
            if len(self._landings) <= MAX_PENDING_LANDINGS and oldest is not None and not oldest.query():
                return
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        landing = self._landings[0]
        if landing.done is not None:
            self.wait_event(landing.done)  # before it leaves the queue: an interrupted wait keeps it there
        self._landings.popleft()
        landing.retired = True
        if landing.then is not None:
            landing.then()

    def retire(self, landing: Landing | None = None) -> None:
        """Wait until `landing` (default: every queued landing) has arrived and its CPU part has
        run; earlier queued landings retire first. Idempotent."""
        if landing is not None and not landing.queued:
            if not landing.retired and landing.done is not None:
                self.wait_event(landing.done)
            landing.retired = True
            return
        while self._landings and (landing is None or not landing.retired):
            self._retire_oldest()

    # -- lifetime ---------------------------------------------------------------------------------
    def end_step(self) -> None:
        self.stats.end_step()

    def close(self) -> None:
        """Finish every transfer and free the pool (the engine's close)."""
        self.order_uploads()
        self.retire()
        self.wait_uploads()
        self.pool.clear()
