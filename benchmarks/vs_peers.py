"""Side by side: plain PyTorch, zeroinf, FSDP2 and DeepSpeed train the same model on the same data.

The model is a Hugging Face Llama built from a config (`--model llama`, presets from `tiny` to `7b`;
no download) or zeroinf's demo GPT (`--model gpt`, presets `98m` and `1b`: pre-LayerNorm blocks of causal
SDPA attention and a GELU MLP, untied head), trained on the same random tokens by every engine at
every placement it supports:

  device    everything on the accelerator
  opt-host  optimizer states and gradients on the host, parameters on the device (ZeRO-Offload)
  host      parameters, gradients and optimizer states on the host
  nvme      parameters and optimizer states on NVMe (gradients too); engine `zeroinf-cache` adds a
            host cache of `--param-cache` bytes per rank for the parameter shards

On CUDA the compute dtype is bf16 (fp32 master weights); on a machine without a GPU every engine
runs on the CPU, with gloo where it needs a process group, in fp32 unless the CPU computes bf16
natively (AVX512-BF16 / AMX). Each run is a fresh process (its peak memory is its own) and the runs
are launched alternately: repeat 1 of every engine and placement, then repeat 2, and so on, so a
drift of the machine spreads over all of them. A run's figure is the median s/step of `--steps`
steps after `--warmup`; the table holds the median over `--repeats`. Engines that are not
installed, or cannot hold a placement, are listed as skipped with the reason.

  python benchmarks/vs_peers.py --preset tiny --repeats 3 --out vs_peers.json
  python benchmarks/vs_peers.py --preset 1b --seq 2048 --batch 4 --placements device,opt-host,host
  python benchmarks/vs_peers.py --model gpt --preset 98m --ranks 2 --threads 1 --seq 128 --batch 1 \
      --engines zeroinf,deepspeed --placements device,opt-host,nvme
  python benchmarks/vs_peers.py --preset 3b --seq 2048 --batch 4 --ckpt --engines zeroinf,fsdp2 \
      --placements device --repeats 1        # the GPU issue's memory row: activation checkpointing

`--ckpt`: activation checkpointing in every engine (zeroinf: `Config(activation_checkpointing=True)`;
the others: Hugging Face's `gradient_checkpointing_enable()`, Llama only).

An engine named with `:compiled` (`--engines plain,plain:compiled,zeroinf,zeroinf:compiled`) trains
through `torch.compile(model, backend=--compile-backend)` (DeepSpeed: `engine.compile(...)`); its
first steps compile, so give it `--warmup` >= 2. The ratios then pair compiled with compiled, and give
each engine's compiled s/step over its eager one.

Prints one JSON object: the machine (CPU model included), the arguments, per (engine, placement) the
median s/step, TFLOP/s, peak GPU memory, peak RSS per rank, bytes moved per step between host and
device and to/from NVMe (zeroinf's own counters; null for the others), the bytes each process read and
wrote per step (`/proc/self/io`, every engine), losses and every repeat; and per placement the
ratios of zeroinf's s/step to each peer's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

PRESETS = {  # hidden, layers, intermediate, heads, kv heads, vocab
    "tiny": (256, 4, 688, 4, 4, 1024),
    "small": (768, 12, 2048, 12, 12, 32000),
    "1b": (2048, 22, 5632, 32, 4, 32000),
    "3b": (3200, 26, 8640, 32, 32, 32000),
    "7b": (4096, 32, 11008, 32, 32, 32000),
}
GPT_PRESETS = {  # d_model, layers, vocab (heads: d_model / 64, MLP 4x, untied head)
    "98m": (768, 12, 8192),
    "1b": (2048, 20, 8192),
}
ENGINES = ("plain", "zeroinf", "zeroinf-cache", "fsdp2", "deepspeed")
PLACEMENTS = ("device", "opt-host", "host", "nvme")
ZEROINF_TIERS = {  # placement: (params, optimizer, gradients)
    "device": ("device", "device", "device"),
    "opt-host": ("device", "host", "host"),
    "host": ("host", "host", "host"),
    "nvme": ("nvme", "nvme", "nvme"),
}


# -- what can run where ----------------------------------------------------------------------------------
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def split_engine(name: str) -> tuple[str, bool]:
    """("zeroinf", True) for "zeroinf:compiled"."""
    base, _, mode = name.partition(":")
    if base not in ENGINES or mode not in ("", "compiled"):
        raise ValueError(f"engine {name!r}: choose from {ENGINES}, each optionally with ':compiled'")
    return base, mode == "compiled"


def skip_reason(name: str, placement: str, model: str, ranks: int, ckpt: bool = False) -> str | None:
    """Why engine `name` cannot run `placement` here, or None."""
    engine, _ = split_engine(name)
    if model == "llama" and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    if engine == "plain" and placement != "device":
        return "plain PyTorch keeps everything on the device"
    if engine == "plain" and ranks > 1:
        return "plain PyTorch runs one process"
    if engine == "zeroinf-cache" and placement != "nvme":
        return "the parameter cache keeps NVMe shards on the host (placement nvme only)"
    if engine == "fsdp2":
        if importlib.util.find_spec("torch.distributed.fsdp") is None:
            return "this PyTorch has no torch.distributed.fsdp"
        if placement == "opt-host":
            return "FSDP2 offloads parameters, gradients and optimizer states together (placement host)"
        if placement == "nvme":
            return "FSDP2 has no NVMe tier"
    if ckpt and model == "gpt" and engine not in ("zeroinf", "zeroinf-cache"):
        return "--ckpt uses Hugging Face's gradient_checkpointing_enable() for the peers: --model llama"
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed; apt-get install libaio-dev for NVMe)"
    return None


# -- one run (a worker process) ----------------------------------------------------------------------------
def build_model(a: argparse.Namespace) -> Any:
    """The model of the run, on the CPU, the same on every rank (seed 0)."""
    torch.manual_seed(0)
    if a.model == "gpt":
        from zeroinf.models.gpt import GPT, GPTConfig

        d, n, vocab = GPT_PRESETS[a.preset]
        gpt = GPTConfig(vocab_size=vocab, seq_len=a.seq, n_layer=n, n_head=d // 64, d_model=d, tie_embeddings=False)
        return GPT(gpt)
    return llama(a.preset, a.seq)


def loss_of(model: Any, x: torch.Tensor, hf: bool) -> torch.Tensor:
    """Next-token loss on tokens `x` (batch, seq + 1) of the model or the engine wrapping it."""
    if hf:  # Hugging Face shifts the labels itself
        return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    return model(x[:, :-1], x[:, 1:])


def vocab_of(model: Any) -> int:
    return model.config.vocab_size if hasattr(model, "config") else model.cfg.vocab_size


def shape_of(model: Any) -> tuple[int, int]:
    """(layers, hidden) for the attention FLOPs."""
    if hasattr(model, "config"):
        return model.config.num_hidden_layers, model.config.hidden_size
    return model.cfg.n_layer, model.cfg.d_model


def llama(preset: str, seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, n, ffn, heads, kv, vocab = PRESETS[preset]
    cfg = LlamaConfig(
        hidden_size=h, num_hidden_layers=n, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def tokens(vocab: int, batch: int, seq: int, step: int, rank: int, device: torch.device) -> torch.Tensor:
    """Each rank's own batch of `seq + 1` random tokens for `step` (the same in every engine)."""
    g = torch.Generator().manual_seed(1000 + 7919 * rank + step)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)


def disk_busy_ms() -> int:
    """Milliseconds spent doing I/O so far, summed over the block devices (/proc/diskstats)."""
    try:
        with open("/proc/diskstats") as f:
            return sum(int(line.split()[12]) for line in f if len(line.split()) > 12)
    except OSError:
        return 0


def wait_for_quiet_disk(quiet_s: float = 2.0, limit_s: float = 120.0) -> float:
    """Flush, then wait until the disks did no I/O for `quiet_s` (at most `limit_s`); seconds waited.

    Deleting a run's swap files makes the kernel discard their blocks (ext4 `discard`) and write
    back what is dirty, in the background: an NVMe run started at once was measured 15-20% slower
    (98M GPT: 2.9-3.1 s/step right after DeepSpeed's NVMe run, 2.5-2.6 alone), so every run starts
    on a quiet disk.
    """
    t0 = time.perf_counter()
    os.sync()
    last = disk_busy_ms()
    while time.perf_counter() - t0 < limit_s:
        time.sleep(quiet_s)
        now = disk_busy_ms()
        if now == last:
            break
        last = now
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(device: torch.device) -> None:
    """The process group of the run: the launcher's environment, or a world of one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        port = str(free_port())
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def proc_io_bytes() -> int:
    """Bytes this process read and wrote on storage (/proc/self/io: O_DIRECT and page-cache writeback alike)."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]) + int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0


def zeroinf_config(a: argparse.Namespace, low: bool) -> Any:
    """zeroinf's Config for `a.placement`: stage 3, bf16 compute where `low`."""
    import zeroinf

    params, optimizer, gradients = ZEROINF_TIERS[a.placement]
    cache = a.param_cache if a.engine == "zeroinf-cache" else 0
    offload = zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, gradients=gradients, nvme_dir=a.nvme_dir, param_cache_bytes=cache
    )
    dtype = "bf16" if low else "fp32"
    return zeroinf.Config(stage=3, param_dtype=dtype, offload=offload, activation_checkpointing=a.ckpt)


def zeroinf_topology(a: argparse.Namespace, device: torch.device) -> Any:
    import zeroinf

    if a.ranks > 1:
        join_world(device)
        return zeroinf.Topology.current(device=device)
    return zeroinf.Topology.single(device)


def setup(a: argparse.Namespace, device: torch.device, dtype: torch.dtype, model: Any) -> tuple[Any, Any]:
    """(step(x) -> loss, zeroinf-sharded module or None) for engine `a.engine` at `a.placement`."""
    low = dtype != torch.float32
    hf = a.model == "llama"
    if a.ckpt and a.engine not in ("zeroinf", "zeroinf-cache"):
        model.gradient_checkpointing_enable()
    compiled = (lambda m: torch.compile(m, backend=a.compile_backend)) if a.compile else (lambda m: m)
    if a.engine == "plain":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        plain = compiled(model)

        def plain_step(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=dtype, enabled=low):
                loss = loss_of(plain, x, hf)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return plain_step, None
    if a.engine in ("zeroinf", "zeroinf-cache"):
        import zeroinf

        topo = zeroinf_topology(a, device)
        sharded = zeroinf.shard(model, zeroinf_config(a, low), topo)
        zopt = zeroinf.AdamW(sharded, lr=1e-4, weight_decay=0.0)
        forward = compiled(sharded)

        def zeroinf_step(x: torch.Tensor) -> torch.Tensor:
            loss = loss_of(forward, x, hf)
            zopt.backward(loss)
            zopt.step()
            zopt.zero_grad()
            return loss

        return zeroinf_step, sharded
    join_world(device)
    if a.engine == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
        if a.placement == "host":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for layer in model.model.layers if hasattr(model, "config") else model.blocks:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        if a.placement == "device":
            model.to(device)
        fopt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)  # CPU too
        fsdp = compiled(model)

        def fsdp2_step(x: torch.Tensor) -> torch.Tensor:
            loss = loss_of(fsdp, x, hf)
            loss.backward()
            fopt.step()
            fopt.zero_grad(set_to_none=True)
            return loss

        return fsdp2_step, None
    import deepspeed

    zo: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9}
    pin = device.type == "cuda"
    if a.placement in ("opt-host", "host"):
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if a.placement == "host":
        zo["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if a.placement == "nvme":
        for kind in ("offload_optimizer", "offload_param"):
            zo[kind] = {"device": "nvme", "nvme_path": a.nvme_dir, "pin_memory": pin}
        # NVMe parameters need no reuse across the prefetch window, and on small models its prefetch
        # may swap a twice-used weight in twice (an error) unless the prefetch bucket is 0. Its optimizer
        # swapper stages whole sub-groups: at 1e9 elements a 1B model's states (16 GB) would be staged at
        # once (killed for memory on 24 GiB), so NVMe gets 1e8, as DeepSpeed's NVMe tutorial suggests.
        zo.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, sub_group_size=1e8)
        # DeepSpeed also keeps a host copy of up to `max_in_cpu` parameter elements (default 1e9) in its
        # optimizer's flat buffers. A model beyond that (the 1B GPT: 1.04e9) fails in 0.19.8 on the CPU
        # in forward ("expected m1 and m2 to have the same dtype ... float != BFloat16"), so the limit
        # covers the model: the same behaviour DeepSpeed has at every size below 1e9 (the 98M runs).
        n_params = sum(p.numel() for p in model.parameters())
        zo["offload_param"]["max_in_cpu"] = max(10**9, n_params)
    ds = {
        "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": low},
        "zero_optimization": zo, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    if a.compile:
        engine.compile(backend=a.compile_backend)

    def deepspeed_step(x: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine, x, hf)
        engine.backward(loss)
        engine.step()
        return loss

    return deepspeed_step, None


def moved_bytes(sharded: Any) -> dict[str, int]:
    import zeroinf

    report = zeroinf.memory_report(sharded)
    last = report["transfers"]["last_step"]
    io = report["io"]
    nvme = int(io["nvme_read_bytes"] + io["nvme_written_bytes"])
    return {"host_device": last["h2d_bytes"] + last["d2h_bytes"], "nvme": nvme}


def worker(a: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    if a.zeroinf_init and a.engine in ("zeroinf", "zeroinf-cache"):  # never whole (the same weights)
        import zeroinf

        with zeroinf.init(zeroinf_config(a, dtype != torch.float32), topology=zeroinf_topology(a, device)):
            model = build_model(a)
    else:
        model = build_model(a)
    n_params = sum(p.numel() for p in model.parameters())
    vocab, (layers, hidden) = vocab_of(model), shape_of(model)
    step, sharded = setup(a, device, dtype, model)
    times, losses, nvme_after_warmup, io_after_warmup = [], [], 0, proc_io_bytes()
    for i in range(a.warmup + a.steps):
        x = tokens(vocab, a.batch, a.seq, i, rank, device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = float(step(x).detach().float())
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        else:
            io_after_warmup = proc_io_bytes()
            if sharded is not None:
                nvme_after_warmup = moved_bytes(sharded)["nvme"]
        losses.append(round(loss, 5))
    s_per_step = statistics.median(times)
    flops_per_token = 6 * n_params + 12 * layers * hidden * a.seq
    moved = moved_bytes(sharded) if sharded is not None else None
    return {
        "rank": rank,
        "s_per_step": s_per_step,
        "tflops": flops_per_token * a.batch * a.seq * a.ranks / s_per_step / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_device_bytes_per_step": moved["host_device"] if moved else None,
        "nvme_bytes_per_step": (moved["nvme"] - nvme_after_warmup) / a.steps if moved else None,
        "proc_io_bytes_per_step": (proc_io_bytes() - io_after_warmup) / a.steps,
        "losses": losses,
        "n_params": n_params,
    }


# -- the side by side (the parent process) ------------------------------------------------------------------
def launch(a: argparse.Namespace, name: str, placement: str, dtype: str, nvme_dir: str) -> dict[str, Any]:
    """One run: `a.ranks` worker processes; rank 0's figures with every rank's peak RSS."""
    engine, compile_it = split_engine(name)
    argv = [
        sys.executable, os.path.abspath(__file__), "--worker", "--engine", engine, "--placement", placement,
        "--dtype", dtype, "--model", a.model, "--preset", a.preset, "--seq", str(a.seq), "--batch", str(a.batch),
        "--steps", str(a.steps), "--warmup", str(a.warmup), "--nvme-dir", nvme_dir, "--ranks", str(a.ranks),
        "--threads", str(a.threads or 0), "--param-cache", str(a.param_cache), *(["--ckpt"] if a.ckpt else []),
        *(["--compile", "--compile-backend", a.compile_backend] if compile_it else []),
        *(["--zeroinf-init"] if a.zeroinf_init else []),
    ]
    env = dict(os.environ)
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    if engine == "deepspeed" and torch.cuda.is_available():  # its op builder fails on arch strings like "9.0a"
        major, minor = torch.cuda.get_device_capability(0)
        env.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    elif engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
    if a.ranks > 1:
        env.update(WORLD_SIZE=str(a.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir)
    wait_for_quiet_disk()
    procs = []
    try:
        for rank in range(a.ranks):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if a.ranks > 1 else env
            procs.append(subprocess.Popen(
                argv, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
        outputs = [p.communicate(timeout=a.run_timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return {"error": f"no result within {a.run_timeout_s} s"}
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    results = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        found = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
        if not found:
            tail = (err or out).strip().splitlines()[-3:]
            return {"error": f"exit code {p.returncode}: " + " | ".join(tail)}
        results.append(found[0])
    first = dict(results[0])
    first["peak_rss_bytes_per_rank"] = [r["peak_rss_bytes"] for r in results]
    return first


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"status": "failed", "error": runs[0]["error"] if runs else "no run"}
    median_run = sorted(ok, key=lambda r: r["s_per_step"])[len(ok) // 2]
    peaks = [r["peak_gpu_bytes"] for r in ok if r["peak_gpu_bytes"] is not None]
    return {
        "status": "ok",
        "s_per_step": statistics.median(r["s_per_step"] for r in ok),
        "tflops": median_run["tflops"],
        "peak_gpu_bytes": max(peaks) if peaks else None,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
        "peak_rss_bytes_per_rank": [max(col) for col in zip(*(r["peak_rss_bytes_per_rank"] for r in ok), strict=True)],
        "host_device_bytes_per_step": median_run["host_device_bytes_per_step"],
        "nvme_bytes_per_step": median_run["nvme_bytes_per_step"],
        "proc_io_bytes_per_step": median_run["proc_io_bytes_per_step"],
        "n_params": median_run["n_params"],
        "losses": median_run["losses"],
        "repeats_s_per_step": [r["s_per_step"] for r in ok],
        "failed_repeats": [r["error"] for r in runs if "error" in r],
    }


def side_by_side(a: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    dtype = a.dtype or ("bf16" if cuda or cpu_has_native_bf16() else "fp32")
    engines = [e for e in a.engines.split(",") if e]
    placements = [p for p in a.placements.split(",") if p]
    results: dict[tuple[str, str], dict[str, Any]] = {}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for engine in engines:
        for placement in placements:
            reason = skip_reason(engine, placement, a.model, a.ranks, a.ckpt)
            if reason is not None:
                results[(engine, placement)] = {"status": "skipped", "reason": reason}
            else:
                runs[(engine, placement)] = []
    nvme_dir = os.path.join(a.nvme_root or tempfile.gettempdir(), f"zeroinf-vs-peers-{os.getpid()}")
    for repeat in range(a.repeats):
        for placement in placements:
            for engine in engines:
                if (engine, placement) in runs:
                    run = launch(a, engine, placement, dtype, nvme_dir)
                    runs[(engine, placement)].append(run)
                    shown = f"{run['s_per_step']:.4f} s/step" if "error" not in run else run["error"]
                    print(f"[repeat {repeat + 1}/{a.repeats}] {engine:18s} {placement:8s} {shown}", file=sys.stderr)
    results.update({key: summarize(r) for key, r in runs.items()})
    return {
        "machine": {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cpu": cpu_name(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "backend": "nccl" if cuda else "gloo", "dtype": dtype,
            "deepspeed": installed_version("deepspeed"),
        },
        "args": {k: v for k, v in vars(a).items() if k not in ("worker", "engine", "placement", "nvme_dir")},
        "results": [{"engine": e, "placement": p, **results[(e, p)]} for p in placements for e in engines],
        "ratios": ratios(results, placements),
    }


def ratios(results: dict[tuple[str, str], dict[str, Any]], placements: list[str]) -> dict[str, dict[str, float]]:
    """Per placement: zeroinf's s/step (and zeroinf-cache's) over each peer's (below 1: zeroinf is faster),
    compiled engines over compiled peers; and each engine's compiled s/step over its eager one."""

    def s_per_step(engine: str, placement: str) -> float | None:
        run = results.get((engine, placement), {})
        return run["s_per_step"] if run.get("status") == "ok" else None

    out: dict[str, dict[str, float]] = {}
    for placement in placements:
        for suffix in ("", ":compiled"):
            for us in ("zeroinf", "zeroinf-cache"):
                ours = s_per_step(us + suffix, placement)
                for peer in ("plain", "fsdp2", "deepspeed"):
                    theirs = s_per_step(peer + suffix, placement)
                    if ours is not None and theirs is not None:
                        out.setdefault(placement, {})[f"{us}{suffix}/{peer}{suffix}"] = ours / theirs
        for engine in ENGINES:
            eager, traced = s_per_step(engine, placement), s_per_step(engine + ":compiled", placement)
            if eager is not None and traced is not None:
                out.setdefault(placement, {})[f"{engine}:compiled/{engine}"] = traced / eager
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama", choices=("llama", "gpt"))
    p.add_argument("--preset", default="tiny", help=f"llama: {sorted(PRESETS)}; gpt: {sorted(GPT_PRESETS)}")
    p.add_argument("--ranks", type=int, default=1, help="processes per run (data parallel)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    p.add_argument(
        "--param-cache", default="2GiB",
        help="engine zeroinf-cache: offload.param_cache_bytes per rank (host memory for NVMe parameter shards)",
    )
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA or a bf16 CPU, else fp32")
    p.add_argument("--nvme-root", help="folder for the nvme placement's files (default: the temp folder)")
    p.add_argument("--run-timeout-s", type=float, default=1800.0)
    p.add_argument("--ckpt", action="store_true", help="activation checkpointing in every engine")
    p.add_argument(
        "--zeroinf-init", action="store_true",
        help="build zeroinf's model under zeroinf.init (never whole in memory): its peak RSS without the eager "
        "fp32 build the peers make; the same weights, but in bf16 the fp32 masters start rounded to bf16 (the "
        "losses part from the eager build's after the first update: docs/design.md)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the ':compiled' engines")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--placement", choices=PLACEMENTS, help=argparse.SUPPRESS)
    p.add_argument("--nvme-dir", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        for name in a.engines.split(","):
            if name:
                split_engine(name)
    except ValueError as e:
        p.error(str(e))
    unknown = [name for name in a.placements.split(",") if name and name not in PLACEMENTS]
    if unknown:  # caught here, not by each worker's own parser after the whole sweep ran
        p.error(f"--placements {','.join(unknown)}: unknown; choose from {','.join(PLACEMENTS)}")
    presets = GPT_PRESETS if a.model == "gpt" else PRESETS
    if a.preset not in presets:
        p.error(f"--preset {a.preset!r} is not a {a.model} preset; choose from {sorted(presets)}")
    if a.worker:
        print("RESULT " + json.dumps(worker(a)), flush=True)
        os._exit(0)  # a slow or failing teardown must not hide the figure
    report = side_by_side(a)
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
