"""Collectives over flat buffers, with async handles; world size 1 turns them into copies.

Stateless functions taking the topology as an argument. gloo has no AVG reduction, so averaging
is a SUM followed by a division, on every backend alike (one code path, identical numerics).

[Note: gloo's all-gather and reduce-scatter as point-to-point messages]
On CPU tensors over gloo, the unit all-gather and reduce-scatter are sent as point-to-point
messages straight between the ranks' buffers. gloo's own versions copy: its all-gather receives
into a freshly allocated flat tensor and then copies every chunk into the output, and its
reduce-scatter clones the whole input, all-reduces it (twice the bytes a reduce-scatter needs) and
copies the rank's slice out. On a CPU every such copy and every first touch of a fresh buffer takes
cycles from the compute of the same cores (98M GPT, 2 ranks x 1 thread: 0.16 s of clones, 0.46 s of
copies in gloo's threads, 100k page faults per step). Here each rank sends its shard to every peer
and receives each peer's shard into its own slot of the output; a reduce-scatter sends each peer the
chunk it owns, receives the first peer's contribution straight into the output shard and adds its
own chunk and the other peers' (scratch, world > 2) in `wait()`, always in the same order: the
result is deterministic, and with two ranks a + b = b + a exactly, as gloo's sum. A reduce-scatter
of a bf16/fp16 input into an fp32 shard sends the input's bytes and sums in fp32 on arrival (the
peers' chunks land in scratch of the input dtype): bit for bit what casting the input to fp32
first would give, with half the bytes sent (planner/unit_plan.py `gradient_buffer_dtype`). Each collective
gets its own tag from a counter that advances identically on every rank (every rank issues the
same collectives in the same order), so messages of overlapping collectives never match each other.
The inputs are read until `wait()`, as with gloo's asynchronous collectives: callers keep them
unchanged until then. NCCL and other devices keep torch.distributed's collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from zeroinf.topology import Topology


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a rank died, hung, or called another collective); the message
    names the collective, its size, this rank and the world."""


@contextlib.contextmanager
def naming_failures(kind: str, numel: int, topo: Topology) -> Iterator[None]:
    """Re-raise a backend error from starting or waiting on a collective as a CollectiveError that says
    which collective and which world (gloo's own message names only a socket or a timeout)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
        raise CollectiveError(
            f"zeroinf: {kind} of {numel} elements failed on rank {topo.rank} of a world of {topo.world_size}: "
            f"{str(exc).strip()} (another rank died, hung past collective_timeout_s, or ran a different collective: "
            "model.state_dict() at stage 3, zeroinf.save and zeroinf.gathered are collectives, called on every "
            "rank, not under `if rank == 0`; and at stage 3 every rank must run the same units in the same order "
            "in forward (an evaluation too: run it on every rank, each on its share of the data), so a layer "
            "skipped on some ranks only (LayerDrop, stochastic depth by layer) cannot run "
            "there: skip inside the layer, by sample, instead; likewise `generate` must run as many forwards on "
            "every rank: Hugging Face turns synced_gpus on for a sharded model, except where a model's own "
            "generate defaults it off (Whisper): pass synced_gpus=True). To find where the ranks part, run again "
            "with Config(check_collectives=True) or ZEROINF_CHECK_COLLECTIVES=1 in the environment"
        ) from exc


# [Note: checking that the ranks call the same collectives]
# Every rank must issue the engine's collectives in the same order. Where one does not (at stage 3 a
# layer skipped on some ranks only, an evaluation run on one rank), gloo aborts the whole process
# from C++ ("Received data size doesn't match expected size") if the sizes differ, NCCL hangs until
# its watchdog, and where the sizes agree (two blocks of one shape) the buffers are silently mixed.
# `Config.check_collectives` puts one small all-reduce before each: the maximum of a fingerprint of
# (kind, size, unit) and of its negation equal this rank's own exactly when every rank's fingerprint
# is the same. On a mismatch every rank sees it at the same collective, gathers the descriptions and
# raises CollectiveError naming what each rank was calling, before the mismatched one is issued.
# `TORCH_DISTRIBUTED_DEBUG=DETAIL` compares shapes only, and not on the point-to-point messages that
# carry gloo's unit collectives here (see above).
def check_same_collective(kind: str, numel: int, what: str, topo: Topology) -> None:
    """With `topo.check_collectives`: stop unless every rank is about to call this same collective."""
    if not topo.check_collectives:
        return
    description = f"{kind} of {numel} elements" + (f" ({what})" if what else "")
    mark = zlib.crc32(description.encode()) & 0x7FFFFFFF
    probe = torch.tensor([mark, -mark], dtype=torch.int64, device=topo.device)
    with naming_failures("collective check", probe.numel(), topo):
        _wait(dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=topo.group, async_op=True), topo)
        if probe.tolist() == [mark, -mark]:
            return
        called: list[object] = [None] * topo.world_size
        dist.all_gather_object(called, description, group=topo.group)
    raise CollectiveError(
        "zeroinf: the ranks called different collectives (found by Config.check_collectives): "
        + "; ".join(f"rank {r}: {c}" for r, c in enumerate(called))
        + ". Every rank must run the same units in the same order at stage 3, in forward and in backward: "
        "skip inside a layer (by sample), not a whole layer on some ranks, and run evaluations on every rank"
    )


# [Note: the collective timeout over a process group made elsewhere]
# `Config.collective_timeout_s` bounds every collective when zeroinf initializes the process group
# (`init_distributed`, or `shard` under torchrun with none yet): the group is made with that timeout.
# A loop written for DDP makes the group itself first (`dist.init_process_group("gloo")`), and its
# timeout, gloo's default of 30 minutes, was then the one that held: a rank stuck elsewhere (an
# evaluation under `if rank == 0` at stage 3) left the others waiting half an hour, not the configured
# ten minutes, before the error that names the likely cause. So on the CPU (gloo), `shard` records the
# configured timeout on its topology and every wait on the engine's collectives passes it to torch
# (`Work.wait(timeout)`, which gloo honours). On CUDA it is not passed: NCCL's `wait(timeout)` blocks
# the CPU until the collective ends, where a plain wait only orders the streams, which the overlap of
# transfers and compute depends on; there the group's own timeout (NCCL's watchdog, 10 minutes by
# default, as the config's) holds.
def _wait(work: dist.Work, topo: Topology) -> None:
    if topo.wait_timeout_s is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=topo.wait_timeout_s))


class Handle(Protocol):
    def wait(self) -> None: ...


class DoneHandle:
    """The handle of a collective that finished synchronously (or was skipped at world size 1)."""

    def wait(self) -> None:
        return None


class ThenHandle:
    """A handle whose first wait() also runs `then` once the wrapped collective is done (releasing
    what it read, for instance)."""

    def __init__(self, handle: Handle, then: Callable[[], None]) -> None:
        self._handle, self._then = handle, then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._handle.wait()
        self._done = True
        self._then()


class WorkHandle:
    """Wraps a torch.distributed Work and runs a completion step (e.g. averaging) after wait()."""

    def __init__(
        self, work: dist.Work, kind: str, topo: Topology, numel: int, then: torch.Tensor | None = None,
        divisor: int = 1,
    ) -> None:
        self._work = work
        self._kind, self._topo, self._numel = kind, topo, numel
        self._then = then
        self._divisor = divisor
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        with naming_failures(self._kind, self._numel, self._topo):
            _wait(self._work, self._topo)
        if self._then is not None and self._divisor != 1:
            self._then.div_(self._divisor)
        self._done = True


class PeerHandle:
    """Point-to-point sends and receives of one collective, then its completion in `wait()`."""

    def __init__(
        self, works: list[dist.Work], kind: str, topo: Topology, numel: int, keep: tuple[torch.Tensor, ...],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._works, self._kind, self._topo, self._numel = works, kind, topo, numel
        self._keep = keep  # the buffers the messages read and write stay alive until they are done
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        with naming_failures(self._kind, self._numel, self._topo):
            for work in self._works:
                _wait(work, self._topo)
        self._works, self._keep = [], ()
        if self._finish is not None:
            self._finish()
        self._done = True


_peer_tags = itertools.count(1)
_TAG_SPAN = 1 << 30  # gloo tags are non-negative 32-bit integers


def _peer_messages(topo: Topology, *tensors: torch.Tensor) -> bool:
    """True when this collective goes as point-to-point messages (see the Note): contiguous CPU
    tensors over gloo."""
    if not topo.is_distributed or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    return dist.get_backend(topo.group) == "gloo"


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_end, b_end = a.data_ptr() + a.numel() * a.element_size(), b.data_ptr() + b.numel() * b.element_size()
    return a_end <= b.data_ptr() or b_end <= a.data_ptr()


def _exchange(
    topo: Topology, send: Callable[[int], torch.Tensor], receive: Callable[[int], torch.Tensor]
) -> list[dist.Work]:
    """Post, for every peer, a send of `send(peer)` and a receive into `receive(peer)` (one tag)."""
    tag = next(_peer_tags) % _TAG_SPAN
    works: list[dist.Work] = []
    for peer in range(topo.world_size):
        if peer == topo.rank:
            continue
        sent = dist.isend(send(peer), group=topo.group, group_dst=peer, tag=tag)
        received = dist.irecv(receive(peer), group=topo.group, group_src=peer, tag=tag)
        assert sent is not None and received is not None  # None only for a rank outside the group: not this one
        works += (sent, received)
    return works


def _gather_by_messages(unsharded: torch.Tensor, shard: torch.Tensor, topo: Topology) -> PeerHandle:
    chunks = unsharded.view(topo.world_size, shard.numel())
    if chunks[topo.rank].data_ptr() != shard.data_ptr():
        chunks[topo.rank].copy_(shard)
    mine = chunks[topo.rank]  # sent from the output: `shard` may have another dtype (cast by the copy)
    works = _exchange(topo, lambda peer: mine, lambda peer: chunks[peer])
    return PeerHandle(works, "all-gather", topo, unsharded.numel(), keep=(unsharded, shard))


def _reduce_scatter_by_messages(
    shard: torch.Tensor, unsharded: torch.Tensor, topo: Topology, divisor: int
) -> PeerHandle:
    """The first peer's chunk lands in `shard` itself (in scratch when the input has a narrower
    dtype than the shard); further peers' (world > 2) in scratch of the input's dtype."""
    world, rank = topo.world_size, topo.rank
    chunks = unsharded.view(world, shard.numel())
    peers = [p for p in range(world) if p != rank]
    widened = unsharded.dtype != shard.dtype
    scratch = torch.empty((world - 1 if widened else world - 2, shard.numel()), dtype=unsharded.dtype)
    if widened:
        landing = dict(zip(peers, scratch, strict=True))
    else:
        landing = {peers[0]: shard, **dict(zip(peers[1:], scratch, strict=True))}
    works = _exchange(topo, lambda peer: chunks[peer], lambda peer: landing[peer])

    def finish() -> None:
        if widened:  # the sums run in the shard's dtype, in the order below, as if cast before sending
            shard.copy_(landing[peers[0]])
        shard.add_(chunks[rank])
        for peer in peers[1:]:
            shard.add_(landing[peer])
        if divisor != 1:
            shard.div_(divisor)

    return PeerHandle(works, "reduce-scatter", topo, unsharded.numel(), keep=(unsharded, shard), finish=finish)


def all_gather_into(
    unsharded: torch.Tensor, shard: torch.Tensor, topo: Topology, async_op: bool = True, what: str = ""
) -> Handle:
    """unsharded[r * shard.numel() : (r + 1) * shard.numel()] = shard of rank r, for every r. `what`
    names it for `check_same_collective`."""
    if unsharded.numel() != shard.numel() * topo.world_size:
        raise ValueError(
            f"all-gather: unsharded numel {unsharded.numel()} != shard numel {shard.numel()} x world {topo.world_size}"
        )
    if not topo.is_distributed:
        if unsharded.data_ptr() != shard.data_ptr():
            unsharded.copy_(shard)
        return DoneHandle()
    check_same_collective("all-gather", unsharded.numel(), what, topo)
    if _peer_messages(topo, unsharded, shard) and (
        _disjoint(unsharded, shard) or shard.data_ptr() == unsharded[topo.rank * shard.numel() :].data_ptr()
    ):  # a separate shard, or the shard is this rank's own slot (in place)
        with naming_failures("all-gather", unsharded.numel(), topo):
            handle = _gather_by_messages(unsharded, shard, topo)
        if not async_op:
            handle.wait()
        return handle
    if shard.dtype != unsharded.dtype:  # an fp32 master held as the shard: the collective wants one dtype
        shard = shard.to(unsharded.dtype)
    with naming_failures("all-gather", unsharded.numel(), topo):
        work = dist.all_gather_into_tensor(unsharded, shard, group=topo.group, async_op=True)
    gathered = WorkHandle(work, "all-gather", topo, unsharded.numel())
    if not async_op:
        gathered.wait()
    return gathered


def reduce_scatter_into(
    shard: torch.Tensor, unsharded: torch.Tensor, topo: Topology, average: bool = True, async_op: bool = True,
    what: str = "",
) -> Handle:
    """shard = (sum over ranks of unsharded)[my slice], divided by world size when `average`."""
    if unsharded.numel() != shard.numel() * topo.world_size:
        raise ValueError(
            f"reduce-scatter: unsharded numel {unsharded.numel()} != "
            f"shard numel {shard.numel()} x world {topo.world_size}"
        )
    if not topo.is_distributed:
        if unsharded.data_ptr() != shard.data_ptr():
            shard.copy_(unsharded)
        return DoneHandle()
    check_same_collective("reduce-scatter", unsharded.numel(), what, topo)
    widening = unsharded.dtype.itemsize < shard.dtype.itemsize
    if (
        _peer_messages(topo, shard, unsharded) and (shard.dtype == unsharded.dtype or widening)
        and _disjoint(shard, unsharded)
    ):
        with naming_failures("reduce-scatter", unsharded.numel(), topo):
            handle: Handle = _reduce_scatter_by_messages(shard, unsharded, topo, topo.world_size if average else 1)
        if not async_op:
            handle.wait()
        return handle
    if unsharded.dtype != shard.dtype:  # the collective wants one dtype
        unsharded = unsharded.to(shard.dtype)
    with naming_failures("reduce-scatter", unsharded.numel(), topo):
        work = dist.reduce_scatter_tensor(shard, unsharded, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    handle = WorkHandle(
        work, "reduce-scatter", topo, unsharded.numel(), then=shard, divisor=topo.world_size if average else 1
    )
    if not async_op:
        handle.wait()
    return handle


def broadcast_to_every_group(tensor: torch.Tensor, topo: Topology, src: int = 0) -> None:
    """`tensor` takes, in place, the values of rank `src` of its group, then under hybrid sharding those
    of the first group ([Note: hybrid sharding]): every rank ends with the same values."""
    if topo.is_distributed:
        dist.broadcast(tensor, group_src=src, group=topo.group)
    if topo.replicas is not None:
        dist.broadcast(tensor, group_src=0, group=topo.replicas.group)


def broadcast_from_first(tensors: Iterable[torch.Tensor], topo: Topology, what: str = "") -> None:
    """Every tensor of `tensors` takes, in place, the values of the group's first rank: one message per
    dtype (the tensors in the same order on every rank). Empty and meta tensors are left as they are,
    and so are expanded ones, which no in-place write can fill (BERT's `position_ids`, an `arange`
    expanded to a batch of one: the same on every rank)."""
    if not topo.is_distributed:
        return
    tensors = list(tensors)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        expanded = any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape, strict=True))
        if t.numel() and not t.is_meta and not expanded:
            by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        wire = flat.view(torch.uint8) if dtype == torch.bool else flat  # gloo carries bytes, not bools
        check_same_collective("broadcast", wire.numel(), what, topo)
        with naming_failures("broadcast", wire.numel(), topo):
            _wait(dist.broadcast(wire, group_src=0, group=topo.group, async_op=True), topo)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
    if topo.replicas is not None:  # hybrid sharding: then from the first group to the others
        broadcast_from_first(tensors, topo.replicas, what)


def all_reduce(
    tensor: torch.Tensor, topo: Topology, average: bool = False, async_op: bool = True, what: str = ""
) -> Handle:
    """tensor = sum (or mean) over ranks of tensor, in place."""
    if not topo.is_distributed:
        return DoneHandle()
    check_same_collective("all-reduce", tensor.numel(), what, topo)
    with naming_failures("all-reduce", tensor.numel(), topo):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    divisor = topo.world_size if average else 1
    handle = WorkHandle(work, "all-reduce", topo, tensor.numel(), then=tensor, divisor=divisor)
    if not async_op:
        handle.wait()
    return handle


# [Note: hybrid sharding]
# `Config.shard_group_size = S` splits a world of W ranks into W/S shard groups of S consecutive
# ranks (a machine's GPUs) and S replica groups (the ranks at the same place in every shard group):
# FSDP's HYBRID_SHARD, DeepSpeed's MiCS. The engine runs over its shard group as over a world of S
# (`Topology.rank`, `world_size`, `group`; parameters gathered there, on the machine's own links),
# and three things reach across (`Topology.replicas`, `Topology.everyone`):
# - every reduced gradient (a unit's shard at stages 2-3, its whole buffer at 0-1) is averaged over
#   the replicas right after its reduction in the group (`average_over_replicas`): the mean over
#   every rank, one all-reduce of 1/S of the unit per rank across machines, where sharding over the
#   world would all-gather and reduce-scatter every unit across them;
# - what every rank must agree on runs over the world: which parameters a backward reaches
#   (runtime/reach.py), so that a unit reduced at the end of backward in one group is in all;
# - the first rank's values reach every rank at `shard` (the units' build, `broadcast_from_first`)
#   and the plan an "auto" config chose.
# Each group then holds the same shards, steps them alike and stays equal bit for bit (the replicas'
# all-reduce of two values is exact whatever its order). Checkpoints: the first group writes, the
# others return its folder (checkpoint/saving.py), every rank's random-number state stored by global
# rank; every group reads it. Gradient averaging is in
# two rounds (within, then across groups), so a world of four in two groups of two adds in another
# order than DDP over four: bitwise DDP in each pair followed by an all-reduce across the pairs
# (tests/test_hybrid_sharding.py), within float rounding of DDP over all four.
def average_over_replicas(tensor: torch.Tensor, topo: Topology, what: str = "") -> None:
    """Hybrid sharding: `tensor`, reduced within its shard group, becomes its mean over the replicas,
    in place ([Note: hybrid sharding]); nothing without replicas."""
    if topo.replicas is not None:
        all_reduce(tensor, topo.replicas, average=True, async_op=False, what=f"{what} across the replicas")
