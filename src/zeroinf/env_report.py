"""`zeroinf env`: what this machine offers zeroinf, for a bug report or before a long run.

DeepSpeed answers with `ds_report`, accelerate with `accelerate env`. Here one report, text or JSON
(`--json`), of what decides whether and how fast a run works: the versions of zeroinf, Python,
PyTorch (its CUDA and NCCL) and of the libraries zeroinf integrates with; the accelerators (memory,
compute capability, native bf16); the CPU (name, cores this process may use, the instruction sets
that decide how fast CPU Adam and bf16 run: AVX2, AVX-512, AVX512-BF16, AMX); host memory, and the
locked-memory limit (RDMA, NCCL over InfiniBand or RoCE between machines, registers memory under
it); /dev/shm (data loader workers); the torch.distributed backends; the launcher's variables.
With `--nvme-dir D` it checks that folder as offload.nvme_dir would be used:
it exists or can be made, is writable, how much is free, its filesystem, and whether it takes
O_DIRECT (tmpfs before Linux 6.6 and some network filesystems do not: the engine then falls back to the page cache,
and says so). Nothing here starts a process group, allocates device memory beyond CUDA's own
initialization, or writes outside `--nvme-dir` (one 4 KiB probe file, removed).
Problems found are listed under "warnings", each with what to do.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from zeroinf.planner.profile import available_ram_bytes, cores, cpu_flags, cpu_name, native_bf16, total_ram_bytes

LIBRARIES = ("transformers", "accelerate", "peft", "trl", "safetensors", "deepspeed", "numpy")
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "ZEROINF_DEVICE")
PROBE_BYTES = 4096
MIN_LOCKED_BYTES = 2**30  # below this, RDMA registration (NCCL between machines) may fail


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _locked_memory_limit() -> int | None:
    """RLIMIT_MEMLOCK in bytes; None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _accelerators() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append({
            "index": index,
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "bf16": bool(props.major >= 8),
        })
    return out


def _filesystem(folder: str) -> str | None:
    """The filesystem type of the mount holding `folder` (/proc/mounts: the longest matching mount point)."""
    path = os.path.realpath(folder)
    best, kind = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and (path == fields[1] or path.startswith(fields[1].rstrip("/") + "/")):
                    if len(fields[1]) > len(best):
                        best, kind = fields[1], fields[2]
    except OSError:
        return None
    return kind


def _takes_o_direct(folder: str) -> bool | str:
    """Write and read back one aligned block with O_DIRECT in `folder`: True, False (the filesystem
    refuses it), or the error that stopped the probe."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, path = tempfile.mkstemp(prefix=".zeroinf-env-", dir=folder)
    os.close(fd)
    buffer = mmap.mmap(-1, PROBE_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        buffer.write(b"z" * PROBE_BYTES)
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return False if exc.errno == errno.EINVAL else f"{type(exc).__name__}: {exc}"
        try:
            os.pwritev(fd, [buffer], 0)
            buffer.seek(0)
            buffer.write(b"\0" * PROBE_BYTES)
            os.preadv(fd, [buffer], 0)
            return buffer[:1] == b"z"
        except OSError as exc:
            return False if exc.errno == errno.EINVAL else f"{type(exc).__name__}: {exc}"
        finally:
            os.close(fd)
    finally:
        buffer.close()
        os.remove(path)


def check_nvme_dir(folder: str) -> dict[str, Any]:
    """offload.nvme_dir as the engine would use it (module docstring); `problem`: why it cannot, or None."""
    out: dict[str, Any] = {"path": os.path.abspath(folder), "problem": None}
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        out["problem"] = f"cannot be created ({exc.strerror}): choose a folder on a local disk you can write"
        return out
    if not os.access(folder, os.W_OK | os.X_OK):
        out["problem"] = "is not writable: choose a writable folder"
        return out
    usage = shutil.disk_usage(folder)
    out.update(free_bytes=usage.free, total_bytes=usage.total, filesystem=_filesystem(folder))
    o_direct = _takes_o_direct(folder)
    out["o_direct"] = o_direct
    if isinstance(o_direct, str):
        out["problem"] = f"the O_DIRECT probe failed ({o_direct})"
    return out


def report(nvme_dir: str | None = None) -> dict[str, Any]:
    """The whole report as plain data (module docstring)."""
    flags = cpu_flags()
    locked = _locked_memory_limit()
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
    cuda = torch.version.cuda
    nccl = None
    if cuda is not None and dist.is_nccl_available():
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    out: dict[str, Any] = {
        "zeroinf": {"version": _version("zeroinf"), "path": os.path.dirname(__file__)},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": {"version": torch.__version__, "cuda": cuda, "hip": torch.version.hip, "nccl": nccl},
        "libraries": {name: _version(name) for name in LIBRARIES},
        "accelerators": _accelerators(),
        "cpu": {
            "name": cpu_name(),
            "cores": cores(),
            "features": {name: name in flags for name in CPU_FEATURES},
            "torch_threads": torch.get_num_threads(),
            "native_bf16": native_bf16("cpu"),
        },
        "memory": {
            "total_bytes": total_ram_bytes(),
            "available_bytes": available_ram_bytes(),
            "locked_limit_bytes": locked,
            "shm_bytes": shm,
        },
        "distributed": {
            "available": dist.is_available(),
            "backends": [b for b, ok in (("nccl", dist.is_nccl_available()), ("gloo", dist.is_gloo_available()),
                                          ("mpi", dist.is_mpi_available())) if ok],
        },
        "environment": {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ},
    }
    if nvme_dir is not None:
        out["nvme_dir"] = check_nvme_dir(nvme_dir)
    out["warnings"] = warnings(out)
    return out


def warnings(found: dict[str, Any]) -> list[str]:
    """What in the report would hurt a run, each with what to do."""
    out = []
    memory, cpu = found["memory"], found["cpu"]
    locked = memory["locked_limit_bytes"]
    if found["accelerators"] and locked is not None and locked < MIN_LOCKED_BYTES:
        out.append(
            f"the locked-memory limit is {locked} bytes (ulimit -l): NCCL between machines over InfiniBand or "
            "RoCE registers memory under it and fails or falls back to sockets; for several machines raise it "
            "(ulimit -l unlimited, memlock in /etc/security/limits.conf, or docker run --ulimit memlock=-1)"
        )
    if memory["shm_bytes"] is not None and memory["shm_bytes"] < 2**30:
        out.append(
            f"/dev/shm holds {memory['shm_bytes']} bytes: DataLoader workers pass batches through it; "
            "enlarge it (docker run --shm-size=8g)"
        )
    if not cpu["features"]["avx2"] and platform.machine() in ("x86_64", "AMD64"):
        out.append("the CPU has no AVX2: CPU Adam (optimizer on the host or NVMe) runs several times slower")
    if not found["accelerators"] and not cpu["native_bf16"]:
        out.append("the CPU computes bf16 without native instructions: on the CPU keep param_dtype='fp32' "
                   "(the default 'auto' does)")
    if "nccl" not in found["distributed"]["backends"] and found["accelerators"]:
        out.append("this torch has no NCCL: several GPUs would communicate through gloo, much slower")
    nvme = found.get("nvme_dir")
    if nvme is not None:
        if nvme["problem"] is not None:
            out.append(f"nvme_dir {nvme['path']!r} {nvme['problem']}")
        elif nvme["o_direct"] is False:
            out.append(
                f"nvme_dir {nvme['path']!r} ({nvme.get('filesystem')}) does not take O_DIRECT: swaps go through "
                "the page cache, which competes with the host memory offloading saves; use a local disk "
                "(ext4, xfs)"
            )
    return out


def _bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def as_text(found: dict[str, Any]) -> str:
    """The report for people: one line per fact, the warnings last."""
    torch_info, cpu, memory = found["torch"], found["cpu"], found["memory"]
    lines = [
        f"zeroinf         {found['zeroinf']['version']} ({found['zeroinf']['path']})",
        f"python          {found['python']} on {found['platform']}",
        f"torch           {torch_info['version']} (cuda {torch_info['cuda']}, nccl {torch_info['nccl']}"
        + (f", hip {torch_info['hip']}" if torch_info["hip"] else "") + ")",
        "libraries       " + ", ".join(f"{k} {v or '-'}" for k, v in found["libraries"].items()),
    ]
    for acc in found["accelerators"] or [None]:
        lines.append(
            "accelerator     none (the CPU is the device)" if acc is None else
            f"accelerator {acc['index']}   {acc['name']}, {_bytes(acc['memory_bytes'])}, "
            f"compute {acc['capability']}, bf16 {'yes' if acc['bf16'] else 'no'}"
        )
    features = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    lines += [
        f"cpu             {cpu['name']}, {cpu['cores']} cores usable, torch threads {cpu['torch_threads']}",
        f"cpu features    {features}",
        f"memory          {_bytes(memory['total_bytes'])} total, {_bytes(memory['available_bytes'])} available, "
        f"locked limit {_bytes(memory['locked_limit_bytes'])}, /dev/shm {_bytes(memory['shm_bytes'])}",
        f"distributed     backends {', '.join(found['distributed']['backends']) or 'none'}",
        "environment     " + (", ".join(f"{k}={v}" for k, v in found["environment"].items()) or "-"),
    ]
    nvme = found.get("nvme_dir")
    if nvme is not None:
        if nvme["problem"] is not None and "free_bytes" not in nvme:
            lines.append(f"nvme_dir        {nvme['path']}: {nvme['problem']}")
        else:
            lines.append(
                f"nvme_dir        {nvme['path']}: {_bytes(nvme['free_bytes'])} free of {_bytes(nvme['total_bytes'])}, "
                f"{nvme['filesystem']}, O_DIRECT {nvme['o_direct']}"
            )
    lines += [f"warning: {w}" for w in found["warnings"]] or ["warnings        none"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nvme-dir", metavar="DIR", help="also check this folder as offload.nvme_dir")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Print the report; exit code 1 when the given nvme_dir cannot be used."""
    found = report(args.nvme_dir)
    print(json.dumps(found, indent=1) if args.json else as_text(found), file=sys.stdout)
    nvme = found.get("nvme_dir")
    return 1 if nvme is not None and nvme["problem"] is not None else 0
