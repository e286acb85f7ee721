"""Who this process is among the data-parallel ranks: rank, world size, process group, device.

A `Topology` is a value passed to everything that communicates; nothing reads global state.
World size 1 is a first-class path: the collectives become copies and no process group is needed.

[Note: a process group that outlives destroy_process_group]
`torch.distributed.nn.functional` evaluates `group.WORLD` in its functions' default arguments when
it is first imported. Nothing imports it until something imports `torch._dynamo`, which
`torch.optim.Optimizer.__init__` does lazily, so in a training script it is first imported after
`init_process_group`, and the default process group is captured in those defaults for good:
`destroy_process_group()` then unregisters the group but cannot free it. Its gloo threads (two
`pt_gloo_runloop` workers and the `gloo_tcp_loop` socket loop) live on into interpreter shutdown,
where they are torn down with the interpreter half gone while the other ranks exit and close their
sockets; that is the "terminate called without an active exception" abort seen after
`destroy_process_group()`. (Measured: with a zeroinf.AdamW built, the three threads were still
there after destroy_process_group() and gc.collect(); importing the module before
init_process_group leaves none.) So this module imports it first: `import zeroinf` before
initializing the process group is enough, and `init_distributed` does it in that order.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroinf.telemetry import get_logger

if TYPE_CHECKING:
    from zeroinf.config import Config

if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn  # noqa: F401  - see [Note: a process group that outlives destroy_process_group]


DEVICE_ENV = "ZEROINF_DEVICE"  # "cpu" runs on the CPU (gloo) even where a GPU is present


def default_device() -> torch.device:
    """The device of this rank: `ZEROINF_DEVICE` when set ("cpu", "cuda", "cuda:1"), else the
    accelerator cuda:LOCAL_RANK, else the CPU when there is none.

    A rank whose LOCAL_RANK has no GPU (more processes per node than GPUs) fails here, naming the
    ranks and the devices, instead of with CUDA's "invalid device ordinal" later."""
    pinned = os.environ.get(DEVICE_ENV, "").strip()
    if pinned:
        device = torch.device(pinned)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        return torch.device("cpu")
    if device.type == "cuda":
        _require_gpu(device)
    return device


def cuda_in_use() -> bool:
    """Whether this process computes on a CUDA device: `ZEROINF_DEVICE` when set, else whether CUDA is
    available. Host memory is pinned, and plans and profiles are made for the GPU, only then: a run
    pinned to the CPU on a GPU machine (the test suite's default) never creates a CUDA context."""
    pinned = os.environ.get(DEVICE_ENV, "").strip()
    if pinned:
        return torch.device(pinned).type == "cuda"
    return torch.cuda.is_available()


def check_ranks_fit(nproc: int) -> None:
    """Before launching `nproc` ranks on this machine: each needs a GPU of its own unless the ranks
    run on the CPU (no CUDA, or ZEROINF_DEVICE=cpu). Raises ValueError naming the fix."""
    if not cuda_in_use():
        return
    count = torch.cuda.device_count()
    if nproc > count:
        raise ValueError(
            f"--nproc {nproc} needs {nproc} GPUs (one per rank) but this machine has {count}: "
            f"use --nproc {count}, or set {DEVICE_ENV}=cpu to run {nproc} ranks on the CPU with gloo"
        )


def _require_gpu(device: torch.device) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index is not None and device.index < count:
        return
    local_rank = os.environ.get("LOCAL_RANK", "0")
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
    visible = f"cuda:0..cuda:{count - 1}" if count else "none"
    raise RuntimeError(
        f"rank with LOCAL_RANK={local_rank} (of {local_world} processes on this node) needs {device}, "
        f"but this machine has {count} CUDA device(s) ({visible}): launch at most {max(count, 1)} "
        f"process(es) per node (torchrun --nproc-per-node {max(count, 1)}), or set {DEVICE_ENV}=cpu "
        "to run every rank on the CPU with gloo"
    )


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


CHECK_COLLECTIVES_ENV = "ZEROINF_CHECK_COLLECTIVES"  # "1": Config.check_collectives for every model


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None = None
    # Seconds a wait on one of the engine's collectives may take (comm.py [Note: the collective timeout
    # over a process group made elsewhere]); None: the process group's own timeout.
    wait_timeout_s: float | None = None
    # Check before each of the engine's collectives that every rank calls the same one
    # (Config.check_collectives; comm.py [Note: checking that the ranks call the same collectives]).
    check_collectives: bool = False
    # Hybrid sharding (Config.shard_group_size): this process among the ranks that hold the same shards
    # as it, one per group; rank, world_size and group above are then those of its shard group.
    replicas: Topology | None = None

    def with_config(self, cfg: Config) -> Topology:
        """This topology with what a config asks of it: its shard group and replicas
        (`shard_group_size`); `check_collectives`, or the environment's ZEROINF_CHECK_COLLECTIVES=1
        (turned on without touching the training script)."""
        topo = self if cfg.shard_group_size is None else self._hybrid(cfg.shard_group_size)
        wanted = cfg.check_collectives or os.environ.get(CHECK_COLLECTIVES_ENV) == "1"
        if wanted and topo.is_distributed and not topo.check_collectives:
            replicas = topo.replicas and dataclasses.replace(topo.replicas, check_collectives=True)
            return dataclasses.replace(topo, check_collectives=True, replicas=replicas)
        return topo

    def _hybrid(self, size: int) -> Topology:
        """This world split into shard groups of `size` consecutive ranks, replicated across them."""
        if self.replicas is not None:
            return self
        if self.group is not None:
            raise ValueError(
                "Config.shard_group_size splits the default process group into shard groups, but this model is "
                "sharded over a process group of its own (Topology.current(group)): leave shard_group_size unset "
                "and give each model the group it shards over"
            )
        if size == self.world_size:
            return self
        if self.world_size % size:
            raise ValueError(
                f"Config.shard_group_size = {size} does not divide the world of {self.world_size} ranks: use a "
                f"divisor of {self.world_size} (the ranks of a machine: {os.environ.get('LOCAL_WORLD_SIZE', '?')})"
            )
        shard_group, replica_group = hybrid_groups(size, self.world_size)
        replicas = dataclasses.replace(
            self, rank=self.rank // size, world_size=self.world_size // size, group=replica_group
        )
        return dataclasses.replace(self, rank=self.rank % size, world_size=size, group=shard_group, replicas=replicas)

    @property
    def leads(self) -> bool:
        """The first rank of the whole training (of the first shard group under hybrid sharding): the
        one that writes what every rank would write alike (a Hugging Face folder)."""
        return self.rank == 0 and (self.replicas is None or self.replicas.rank == 0)

    @property
    def everyone(self) -> Topology:
        """Every rank of the training: the whole world under hybrid sharding (what every rank must agree
        on, such as which parameters a backward reaches), else this topology."""
        if self.replicas is None:
            return self
        return dataclasses.replace(
            self, rank=dist.get_rank(), world_size=dist.get_world_size(), group=None, replicas=None
        )

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"world size {self.world_size} needs an initialized process group: "
                "call zeroinf.init_distributed() or torch.distributed.init_process_group() first"
            )

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def process_rank(self) -> int:
        """This process's rank in the default process group (this topology's rank when there is none):
        what names its swap files. A model sharded over a group has group ranks that other groups'
        processes also have (two groups of two ranks each have a rank 0), and may share their folder."""
        return dist.get_rank() if dist.is_initialized() else self.rank

    @classmethod
    def single(cls, device: torch.device | None = None) -> Topology:
        return cls(rank=0, world_size=1, device=device or default_device())

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> Topology:
        """The topology of `group` (default: the world), or a single process when none is initialized."""
        if not dist.is_initialized():
            return cls.single(device)
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(
                f"Topology.current: global rank {dist.get_rank()} is not a member of the process group it was "
                "given; each process shards its model over a group it belongs to"
            )
        return cls(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            device=device or default_device(),
            group=group,
        )


_HYBRID_GROUPS: dict[tuple[int, int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def hybrid_groups(size: int, world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's shard group (`size` consecutive ranks) and replica group (the ranks at its place
    in every shard group), made once per process: making a group is a collective of every rank."""
    key = (size, world_size, id(dist.group.WORLD))  # a process group made anew makes its own
    if key not in _HYBRID_GROUPS:
        shards = [list(range(start, start + size)) for start in range(0, world_size, size)]
        replicas = [list(range(place, world_size, size)) for place in range(size)]
        shard_group, _ = dist.new_subgroups_by_enumeration(shards)
        replica_group, _ = dist.new_subgroups_by_enumeration(replicas)
        _HYBRID_GROUPS[key] = (shard_group, replica_group)
    return _HYBRID_GROUPS[key]


def default_topology(timeout_s: float = 600.0) -> Topology:
    """The topology `zeroinf.shard` / `zeroinf.init` use when given none: the default process group's.
    Under torchrun (WORLD_SIZE > 1) with no process group yet, it is initialized here first, as
    DeepSpeed's `initialize` and accelerate's `Accelerator` do: otherwise every rank would train a
    world of its own, silently (the same batches, no averaging) unless something else collided."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        topo = init_distributed(timeout_s)
        get_logger().info(
            "initialized the default process group from torchrun's environment: rank %d of %d, %s",
            topo.rank, topo.world_size, dist.get_backend(),
        )
        return topo
    topo = Topology.current()
    if topo.is_distributed and topo.device.type == "cpu":  # comm.py [Note: the collective timeout over ...]
        topo = dataclasses.replace(topo, wait_timeout_s=timeout_s)
    return topo


def init_distributed(timeout_s: float = 600.0) -> Topology:
    """Initialize the default process group from torchrun's environment, if there is one.

    `timeout_s` bounds every collective (pass `Config.collective_timeout_s`): a rank that dies or
    hangs makes the others fail with an error after at most that long instead of waiting forever.
    Safe to call more than once and in a plain single process (then it returns a world of one).
    """
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(
            backend=default_backend(device), timeout=datetime.timedelta(seconds=timeout_s)
        )
        # Every rank connected before any goes on: a rank that then stops on a user error leaves its
        # group at once (cli.leave_process_group), which closed the socket of a peer still connecting
        # inside init_process_group ("Gloo connectFullMesh failed ... Connection closed by peer").
        dist.barrier(device_ids=[device.index] if device.type == "cuda" and device.index is not None else None)
    return Topology.current(device=device)
