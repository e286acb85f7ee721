"""The machine profile: what this machine computes, copies, reads and writes per second.

`MachineProfile` is plain data the estimator reads. `load_profile()` returns the cached measurement
of this machine (`zeroinf plan --measure` writes it to the user cache folder, e.g.
~/.cache/zeroinf/machine-<key>.json) or conservative defaults with `measured=False`, which the
planner reports as a notice. `measure_profile()` runs short probes (well under a minute): matmul
FLOP/s per dtype and operand size, memory bandwidth, the fused CPU AdamW, host copies, the NVMe
folder through our own aio engine, and the collectives at a world size (gloo ranks on CPU).

`native_bf16()` answers whether the compute device runs bf16 in hardware: CUDA devices that report
bf16 support without emulation; CPUs with AMX-BF16 or AVX512-BF16 (read from /proc/cpuinfo flags,
with PyTorch's CPU capability as a second opinion). `Config(param_dtype="auto")` uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import operator
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch

from zeroinf.topology import cuda_in_use

PROFILE_VERSION = 4
MATMUL_SIZES = (64, 128, 256, 512, 1024, 2048)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX / AVX512-BF16; aarch64 "bf16" (BFMMLA)


# -- hardware facts -------------------------------------------------------------------------------------
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / aarch64
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def native_bf16(device_type: str | None = None) -> bool:
    """Whether the compute device has bf16 arithmetic in hardware (not emulated).

    CUDA: `torch.cuda.is_bf16_supported(including_emulation=False)`. CPU: the AMX-BF16 or
    AVX512-BF16 instruction sets (aarch64: the bf16 feature), from /proc/cpuinfo, or PyTorch's
    CPU capability naming AMX. A CPU with AVX2 only (or AVX512 without BF16) emulates bf16.
    """
    device_type = device_type or ("cuda" if cuda_in_use() else "cpu")
    if device_type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if cpu_flags() & set(BF16_CPU_FLAGS):
        return True
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability


def auto_param_dtype(device_type: str | None = None) -> str:
    """`param_dtype = "auto"`: bf16 where the device computes it natively, else fp32 (never fp16)."""
    return "bf16" if native_bf16(device_type) else "fp32"


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    """MemAvailable: what new allocations can get without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_ram_bytes()


def rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def interpolate(points: tuple[tuple[int, float], ...] | list[tuple[int, float]], size: float) -> float:
    """The rate at `size` from (size, rate) points: linear in log size, clamped at the ends."""
    points = sorted(points)
    if size <= points[0][0]:
        return points[0][1]
    for (s0, r0), (s1, r1) in zip(points, points[1:], strict=False):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return r0 + w * (r1 - r0)
    return points[-1][1]


# -- the profile ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MachineProfile:
    """Rates of this machine, measured (`measured`) or conservative defaults. Plain data."""

    cpu: str
    device: str
    """"cpu", or the accelerator's name."""
    cores: int
    bf16_native: bool
    ram_bytes: int
    device_memory_bytes: int | None
    """Accelerator memory; None when the device is the CPU (device and host share the RAM)."""
    matmul_flops: dict[str, tuple[tuple[int, float], ...]]
    """dtype -> ((operand size, FLOP/s), ...) of a square matmul on the device, with `threads` threads."""
    memory_bps: float
    """Device memory bandwidth seen by element-wise operators (bytes read + written per second)."""
    adam_params_per_s: float
    """The fused AdamW kernel on the CPU (host and nvme optimizer states), with `threads` threads."""
    device_adam_params_per_s: float
    copy_bps: float
    """Host memory copies (and host <-> device copies on an accelerator), bytes per second."""
    disk_read_bps: float
    disk_write_bps: float
    disk_dir: str | None
    """The folder the disk figures were measured in (the NVMe swap folder)."""
    collective_bps: dict[int, float]
    """world size -> all-gather bus bandwidth per rank (bytes received per second)."""
    collective_latency_s: float
    baseline_rss_bytes: int
    """Resident memory of a process that imported torch and zeroinf, before any model."""
    measured: bool
    source: str
    notes: tuple[str, ...] = field(default=())
    threads: int = 0
    """CPU threads the figures above were taken with (0: `cores`)."""
    single_thread: dict[str, Any] = field(default_factory=dict)
    """The CPU figures with one thread: "matmul_flops" (CPU device only), "memory_bps", "adam_params_per_s",
    "copy_bps". A rank of a run with several ranks on this machine gets cores / ranks threads; its
    figures are interpolated between these and the all-thread ones (`for_rank`)."""
    concurrent_matmul_flops: dict[int, float] = field(default_factory=dict)
    """ranks -> fp32 FLOP/s (operand size 512) of one of `ranks` processes computing at once on this
    machine, each with cores / ranks threads: what a rank gets when its neighbours are busy too."""
    compute_efficiency: float = 1.0
    """Measured / predicted time of a reference training step in fp32 (forward + backward of a 25M
    GPT at stage 3, one thread): what the per-operator model misses (rectangular matmuls, attention,
    GELU, hooks). Compute predictions in a dtype without its own figure are multiplied by it."""
    dtype_efficiency: dict[str, float] = field(default_factory=dict)
    """dtype other than fp32 -> the same ratio measured in that dtype (bf16 where the CPU computes it
    natively: its element-wise operators and conversions cost more than the matmul probe shows). See
    `efficiency`."""

    def efficiency(self, dtype: str) -> float:
        """The calibration factor of compute in `dtype` (its own, else fp32's)."""
        return self.dtype_efficiency.get(dtype, self.compute_efficiency)

    def for_rank(self, threads: int, ranks: int = 1) -> MachineProfile:
        """The figures one of `ranks` processes on this machine sees with `threads` CPU threads."""
        out = self.for_threads(threads)
        if self.device != "cpu" or ranks < 2 or ranks not in self.concurrent_matmul_flops:
            return out
        alone = out.matmul_rate("fp32", 512)
        share = min(1.0, self.concurrent_matmul_flops[ranks] / alone) if alone > 0 else 1.0
        return dataclasses.replace(
            out,
            matmul_flops={k: tuple((s, r * share) for s, r in v) for k, v in out.matmul_flops.items()},
            memory_bps=out.memory_bps * share,
            adam_params_per_s=out.adam_params_per_s * share,
            device_adam_params_per_s=out.device_adam_params_per_s * share,
        )

    def for_threads(self, threads: int) -> MachineProfile:
        """The figures one rank sees with `threads` CPU threads (linear between 1 and `threads` of the probe)."""
        full = self.threads or self.cores
        threads = max(1, min(threads, full))
        if threads == full or not self.single_thread:
            return self
        w = (threads - 1) / (full - 1) if full > 1 else 1.0

        def mix(one: float, many: float) -> float:
            return one + w * (many - one)

        one = self.single_thread
        changes: dict[str, Any] = {"threads": threads}
        for name in ("adam_params_per_s", "copy_bps"):
            if name in one:
                changes[name] = mix(one[name], getattr(self, name))
        if self.device == "cpu":
            if "memory_bps" in one:
                changes["memory_bps"] = mix(one["memory_bps"], self.memory_bps)
            changes["device_adam_params_per_s"] = changes.get("adam_params_per_s", self.adam_params_per_s)
            table = one.get("matmul_flops", {})
            changes["matmul_flops"] = {
                dtype: tuple(
                    (size, mix(interpolate(table[dtype], size) if table.get(dtype) else rate / full, rate))
                    for size, rate in points
                )
                for dtype, points in self.matmul_flops.items()
            }
        return dataclasses.replace(self, **changes)

    def matmul_rate(self, dtype: str, size: int) -> float:
        """FLOP/s of a matmul of operand size `size` (interpolated in log size, clamped at the ends)."""
        return interpolate(self.matmul_flops.get(dtype) or self.matmul_flops["fp32"], size)

    def collective_rate(self, world_size: int) -> float:
        if world_size in self.collective_bps:
            return self.collective_bps[world_size]
        if self.collective_bps:  # the nearest measured world, scaled by the ring's (w-1)/w
            nearest = min(self.collective_bps, key=lambda w: abs(w - world_size))
            return self.collective_bps[nearest]
        return self.copy_bps / 4

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["collective_bps"] = {str(k): v for k, v in self.collective_bps.items()}
        data["concurrent_matmul_flops"] = {str(k): v for k, v in self.concurrent_matmul_flops.items()}
        data["version"] = PROFILE_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineProfile:
        data = dict(data)
        if data.pop("version", None) != PROFILE_VERSION:
            raise ValueError("machine profile of another version: measure again with `zeroinf plan --measure`")
        data["collective_bps"] = {int(k): float(v) for k, v in data["collective_bps"].items()}
        data["concurrent_matmul_flops"] = {
            int(k): float(v) for k, v in (data.get("concurrent_matmul_flops") or {}).items()
        }
        data["matmul_flops"] = {k: tuple((int(s), float(r)) for s, r in v) for k, v in data["matmul_flops"].items()}
        data["notes"] = tuple(data.get("notes", ()))
        data["dtype_efficiency"] = {str(k): float(v) for k, v in (data.get("dtype_efficiency") or {}).items()}
        single = dict(data.get("single_thread") or {})
        if "matmul_flops" in single:
            single["matmul_flops"] = {
                k: tuple((int(s), float(r)) for s, r in v) for k, v in single["matmul_flops"].items()
            }
        data["single_thread"] = single
        return cls(**data)


def device_name() -> str:
    if cuda_in_use():
        return torch.cuda.get_device_name()
    return "cpu"


def machine_key() -> str:
    """Names this machine's profile: host, CPU, cores and accelerator."""
    text = "|".join((platform.node(), cpu_name(), str(cores()), device_name(), torch.__version__))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("ZEROINF_CACHE_DIR") or os.path.join(base, "zeroinf"))


def cache_path() -> Path:
    return cache_dir() / f"machine-{machine_key()}.json"


def default_profile() -> MachineProfile:
    """Conservative figures for this kind of machine, used until `zeroinf plan --measure` runs."""
    n = cores()
    bf16 = native_bf16()
    if cuda_in_use():
        free, total = torch.cuda.mem_get_info()
        dense = 50e12 if bf16 else 10e12
        matmul = {
            "fp32": tuple((s, min(dense / 4, 2e9 * s)) for s in MATMUL_SIZES),
            "bf16": tuple((s, min(dense, 4e9 * s)) for s in MATMUL_SIZES),
            "fp16": tuple((s, min(dense, 4e9 * s)) for s in MATMUL_SIZES),
        }
        device_memory: int | None = total
        memory_bps, device_adam, copy_bps = 500e9, 5e9, 8e9
    else:
        per_core = 8e9  # fp32 FLOP/s of one core at large sizes (AVX2), a low estimate
        ramp = {64: 0.15, 128: 0.3, 256: 0.5, 512: 0.7, 1024: 0.85, 2048: 1.0}
        fp32 = tuple((s, per_core * n * ramp[s]) for s in MATMUL_SIZES)
        half = tuple((s, r * (2.0 if bf16 else 0.03)) for s, r in fp32)
        matmul = {"fp32": fp32, "bf16": half, "fp16": half if bf16 else tuple((s, r * 0.03) for s, r in fp32)}
        device_memory = None
        memory_bps, copy_bps = 2e9 * n, 2e9 * n
        device_adam = 50e6 * n
    return MachineProfile(
        cpu=cpu_name(), device=device_name(), cores=n, bf16_native=bf16, ram_bytes=total_ram_bytes(),
        device_memory_bytes=device_memory, matmul_flops=matmul, memory_bps=memory_bps,
        adam_params_per_s=50e6 * n, device_adam_params_per_s=device_adam, copy_bps=copy_bps,
        disk_read_bps=0.5e9, disk_write_bps=0.25e9, disk_dir=None,
        collective_bps={}, collective_latency_s=1e-3, baseline_rss_bytes=400 * 2**20,
        measured=False, source="defaults", threads=n,
        single_thread={
            "matmul_flops": (
                {k: tuple((s, r / n) for s, r in v) for k, v in matmul.items()} if device_memory is None else {}
            ),
            "memory_bps": memory_bps / n if device_memory is None else memory_bps,
            "adam_params_per_s": 50e6, "copy_bps": copy_bps / n if device_memory is None else copy_bps,
        },
    )


def load_profile(path: Path | None = None) -> MachineProfile:
    """This machine's cached measurement, or the defaults (`measured=False`) when there is none."""
    path = path or cache_path()
    try:
        return MachineProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return default_profile()


def save_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    tmp.replace(path)
    return path


# -- probes -------------------------------------------------------------------------------------------------
def _rate(
    work: float, run: Callable[[], Any], budget_s: float, sync: Callable[[], None], best: bool = True
) -> float:
    """Work per second of `run`, repeated for about `budget_s` after one warm-up; the best of 3 rounds
    (or their median: what a busy machine gives most of the time)."""
    run()
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, int(budget_s / 3 / once))
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        sync()
        rates.append(work * reps / (time.perf_counter() - t0))
    return max(rates) if best else sorted(rates)[1]


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def probe_matmul(
    device: torch.device, budget_s: float = 0.2, sizes: tuple[int, ...] = MATMUL_SIZES
) -> dict[str, tuple[tuple[int, float], ...]]:
    """FLOP/s of square matmuls per dtype and size. A dtype the device emulates (bf16 on a CPU
    without bf16 instructions) is measured at the small sizes only and held flat above."""
    out = {}
    sync = _sync(device)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        points: list[tuple[int, float]] = []
        warm = torch.ones(256, 256, device=device, dtype=dtype)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:  # wake the thread pool and the kernels of this dtype
            warm @ warm
        for size in sizes:
            work = 2.0 * size**3
            if points and size >= 256 and work / points[-1][1] > 0.25:  # slow (an emulated dtype): hold
                points.append((size, points[-1][1]))
                continue
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            points.append((size, _rate(work, functools.partial(operator.matmul, a, b), budget_s, sync)))
        out[name] = tuple(points)
    return out


def probe_memory(device: torch.device, budget_s: float = 0.5) -> float:
    x = torch.ones(2**24, device=device)
    y = torch.ones(2**24, device=device)
    return _rate(3.0 * x.numel() * 4, lambda: torch.add(x, y, out=x), budget_s, _sync(device))


def probe_copy(budget_s: float = 0.4) -> float:
    src = torch.ones(2**24)
    dst = torch.empty(2**24)
    return _rate(2.0 * src.numel() * 4, lambda: dst.copy_(src), budget_s, lambda: None)


def probe_adam(device: torch.device, budget_s: float = 1.0) -> float:
    from torch.optim.adamw import adamw

    n = 2**22
    p, g = torch.randn(n, device=device), torch.randn(n, device=device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    step = torch.zeros((), device=device)

    def run() -> None:
        adamw([p], [g], [m], [v], [], [step], fused=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4,
              weight_decay=0.1, eps=1e-8, maximize=False)

    return _rate(float(n), run, budget_s, _sync(device))


def probe_disk(folder: str, size_bytes: int = 512 * 2**20) -> tuple[float, float]:
    """(read, write) bytes/s at `folder` through zeroinf's aio engine (O_DIRECT), as bench-io measures."""
    from zeroinf.aio.bench import measure
    from zeroinf.aio.config import AioConfig

    result = measure(folder, size_bytes, AioConfig())
    return result["read_gbps"] * 1e9, result["write_gbps"] * 1e9


def _collective_rank(rank: int, world: int, path: str, nbytes: int) -> tuple[float, float, float]:
    """One rank of the collective probe: (seconds per all-gather of `nbytes`, seconds per tiny
    all-reduce, fp32 FLOP/s of a 512 matmul while every rank computes)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(max(1, cores() // world))
    dist.init_process_group(
        "gloo", store=dist.FileStore(path, world), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    shard = torch.ones(nbytes // 4 // world)
    full = torch.empty(shard.numel() * world)
    tiny = torch.ones(1)
    for _ in range(2):
        dist.all_gather_into_tensor(full, shard)
    dist.barrier()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_gather_into_tensor(full, shard)
    big_s = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(20):
        dist.all_reduce(tiny)
    small_s = (time.perf_counter() - t0) / 20
    a = torch.randn(512, 512)
    dist.barrier()
    flops = _rate(2.0 * 512**3, lambda: a @ a, 1.5, lambda: None, best=False)
    dist.destroy_process_group()
    return big_s, small_s, flops


def probe_collectives(
    world: int, nbytes: int = 64 * 2**20, timeout_s: float = 120.0
) -> tuple[float, float, float]:
    """(bus bytes/s per rank, latency s) of gloo all-gathers among `world` processes on this machine,
    and the fp32 FLOP/s each of them gets while all compute at once."""
    import subprocess
    import sys

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(max(1, cores() // world))
    with tempfile.TemporaryDirectory(prefix="zeroinf-probe-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "zeroinf.planner.profile", "--collective-rank", str(r), str(world), store,
                 str(nbytes)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            for r in range(world)
        ]
        try:
            outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        raise RuntimeError(f"the collective probe among {world} gloo ranks failed (exit codes {codes})")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    big_s, small_s = results[0][0], results[0][1]
    flops = min(r[2] for r in results)
    received = nbytes * (world - 1) / world
    return received / max(big_s - small_s, 1e-6), small_s, flops


class _GPTSizes(TypedDict):
    """`GPTConfig` fields of the reference model (the others keep their defaults)."""

    seq_len: int
    n_layer: int
    n_head: int
    d_model: int


# [Note: the calibrating reference model]
# The reference step calibrates what the per-operator model misses. It was a 3.3M GPT (d_model 256):
# there per-operator costs and small matmuls' inefficiency weigh, and the factor they gave (1.36 on an
# AVX-512 EPYC in fp32) then inflated every larger model's compute, whose matmuls the probe predicts
# well: an 85M GPT at world 2 was predicted at 5.5 s a step against 3.5 measured. Measured/predicted
# at one thread there, fp32: 1.37 at 3.3M, 1.05 at 25M, 1.00 at 85M; bf16: 1.74, 1.55, 1.42. Models
# worth planning are larger still, so the reference is the 25M one (d_model 512, 8 layers; about
# 1 s a step in fp32 on one core), and bf16 gets its own factor where the CPU computes it natively
# (its element-wise operators and conversions are slower than its matmuls suggest).
REFERENCE_GPT: _GPTSizes = {"seq_len": 256, "n_layer": 8, "n_head": 8, "d_model": 512}
REFERENCE_BATCH = 2


def _reference_step(dtype: str = "fp32") -> dict[str, Any]:
    """In a fresh process with one thread: train the reference GPT at stage 3 (in memory, compute in
    `dtype`) for a few steps; the median forward + backward seconds, the peak RSS and the ledger's
    peak bytes."""
    torch.set_num_threads(1)
    import zeroinf
    from zeroinf.models.gpt import GPT, GPTConfig

    cfg = zeroinf.Config(stage=3, param_dtype=dtype)
    with zeroinf.init(cfg):
        model = GPT(GPTConfig(**REFERENCE_GPT))
    zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=1e-4)
    data = torch.randint(0, 256, (REFERENCE_BATCH, REFERENCE_GPT["seq_len"] + 1))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        opt.backward(model(data[:, :-1], data[:, 1:]))
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    last = zeroinf.memory_report(model)["last_step"]
    peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return {
        "forward_backward_s": sorted(times[1:])[len(times[1:]) // 2],
        "peak_rss_bytes": peak,
        "ledger_bytes": sum(last[t]["peak_bytes"] for t in ("device", "host")),
    }


def probe_reference_step(dtype: str = "fp32", timeout_s: float = 120.0) -> dict[str, Any]:
    """`_reference_step(dtype)` in a fresh process (its own peak RSS and thread count)."""
    import subprocess
    import sys

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "zeroinf.planner.profile", "--reference-step", dtype], env=env, capture_output=True,
        text=True, timeout=timeout_s, check=False,
    )
    if out.returncode:
        raise RuntimeError(f"the reference training step failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def calibrate(profile: MachineProfile, references: dict[str, dict[str, Any]]) -> MachineProfile:
    """Set `compute_efficiency` (fp32), `dtype_efficiency` and `baseline_rss_bytes` from reference
    steps by dtype (`probe_reference_step`; "fp32" required)."""
    from zeroinf.config import Config
    from zeroinf.models.gpt import GPTConfig
    from zeroinf.planner.estimate import activation_peak, pass_seconds
    from zeroinf.planner.model_facts import from_gpt_config

    one = dataclasses.replace(profile.for_threads(1), compute_efficiency=1.0, dtype_efficiency={})
    model = from_gpt_config(GPTConfig(**REFERENCE_GPT))
    facts = {
        dtype: model.pass_facts(REFERENCE_BATCH, REFERENCE_GPT["seq_len"], dtype, torch.device("cpu"))
        for dtype in references
    }
    efficiency: dict[str, float] = {}
    for dtype, reference in references.items():
        predicted = 3 * pass_seconds(facts[dtype], dtype, one)
        ratio = reference["forward_backward_s"] / predicted if predicted > 0 else 1.0
        efficiency[dtype] = min(4.0, max(0.25, ratio))
    fp32 = references["fp32"]
    activations, _ = activation_peak(facts["fp32"], Config(stage=3))
    baseline = fp32["peak_rss_bytes"] - fp32["ledger_bytes"] - activations
    return dataclasses.replace(
        profile, compute_efficiency=efficiency.pop("fp32"), dtype_efficiency=efficiency,
        baseline_rss_bytes=max(baseline, profile.baseline_rss_bytes),
    )


class _threads:
    """`torch.set_num_threads(n)` for a block."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def measure_profile(
    nvme_dir: str | None, world_sizes: tuple[int, ...] = (), log: Callable[[str], None] = lambda s: None
) -> MachineProfile:
    """Run the probes (about 30-50 s) and return a measured profile (the caller caches it with `save_profile`).

    CPU figures are taken with every core and with one thread, so a plan for several ranks per
    machine (each with its share of the cores) reads its rank's figures (`MachineProfile.for_threads`).
    """
    baseline = rss_bytes()
    device = torch.device("cuda") if cuda_in_use() else torch.device("cpu")
    base = default_profile()
    n = cores()
    with _threads(n):
        log(f"matmul FLOP/s per dtype ({n} threads) ...")
        matmul = probe_matmul(device)
        log("memory bandwidth, copies, CPU AdamW ...")
        memory_bps = probe_memory(device)
        copy_bps = probe_copy()
        adam = probe_adam(torch.device("cpu"))
        device_adam = probe_adam(device) if device.type == "cuda" else adam
    single: dict[str, Any] = {}
    if n > 1:
        with _threads(1):
            log("the same with one thread ...")
            if device.type == "cpu":
                single["matmul_flops"] = probe_matmul(device, budget_s=0.1, sizes=(64, 256, 1024))
                single["memory_bps"] = probe_memory(device, budget_s=0.3)
            single["copy_bps"] = probe_copy(budget_s=0.3)
            single["adam_params_per_s"] = probe_adam(torch.device("cpu"), budget_s=0.5)
    read_bps, write_bps, disk_dir = base.disk_read_bps, base.disk_write_bps, None
    notes = []
    if nvme_dir is not None:
        log(f"disk read/write at {nvme_dir} through the aio engine ...")
        read_bps, write_bps = probe_disk(nvme_dir)
        disk_dir = os.path.abspath(nvme_dir)
    else:
        notes.append("disk not measured: pass --nvme-dir")
    collective: dict[int, float] = {}
    concurrent: dict[int, float] = {}
    latency = base.collective_latency_s
    for world in sorted({w for w in world_sizes if w > 1}):
        if device.type == "cuda":
            notes.append(f"collectives at world {world} not measured on this machine (NCCL probe not implemented)")
            continue
        log(f"collectives and compute among {world} gloo ranks ...")
        collective[world], latency, concurrent[world] = probe_collectives(world)
    if not native_bf16():
        notes.append(f"{cpu_name() if device.type == 'cpu' else device_name()}: no native bf16 (emulated, slow)")
    measured = dataclasses.replace(
        base, matmul_flops=matmul, memory_bps=memory_bps, adam_params_per_s=adam, device_adam_params_per_s=device_adam,
        copy_bps=copy_bps, disk_read_bps=read_bps, disk_write_bps=write_bps, disk_dir=disk_dir,
        collective_bps=collective, collective_latency_s=latency, baseline_rss_bytes=baseline, measured=True,
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')}", notes=tuple(notes), threads=n, single_thread=single,
        concurrent_matmul_flops=concurrent,
    )
    if device.type == "cpu":
        dtypes = ("fp32", "bf16") if native_bf16() else ("fp32",)  # emulated bf16 is never chosen by auto
        log(f"reference training steps (calibration, {', '.join(dtypes)}) ...")
        measured = calibrate(measured, {dtype: probe_reference_step(dtype) for dtype in dtypes})
    return measured


def merge_profiles(old: MachineProfile, new: MachineProfile) -> MachineProfile:
    """Keep what `old` measured and `new` did not (another disk folder, another world size)."""
    collective = {**old.collective_bps, **new.collective_bps}
    concurrent = {**old.concurrent_matmul_flops, **new.concurrent_matmul_flops}
    new = dataclasses.replace(new, concurrent_matmul_flops=concurrent)
    if new.disk_dir is None and old.disk_dir is not None:
        new = dataclasses.replace(
            new, disk_read_bps=old.disk_read_bps, disk_write_bps=old.disk_write_bps, disk_dir=old.disk_dir
        )
    return dataclasses.replace(new, collective_bps=collective)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--collective-rank"]:
        rank_, world_, store_, nbytes_ = sys.argv[2:6]
        print(json.dumps(_collective_rank(int(rank_), int(world_), store_, int(nbytes_))))
    elif sys.argv[1:2] == ["--reference-step"]:
        print(json.dumps(_reference_step(*sys.argv[2:3])))
