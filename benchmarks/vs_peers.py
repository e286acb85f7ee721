"""Side by side: plain PyTorch, zeroinf, FSDP2 and DeepSpeed train the same Hugging Face Llama.

The model is built from a config (presets from `tiny` to `7b`; no download) and trained on the same
random tokens by every engine at every placement it supports:

  device    everything on the accelerator
  opt-host  optimizer states and gradients on the host, parameters on the device (ZeRO-Offload)
  host      parameters, gradients and optimizer states on the host
  nvme      parameters and optimizer states on NVMe (gradients too)

On CUDA the compute dtype is bf16 (fp32 master weights); on a machine without a GPU every engine
runs on the CPU, with gloo where it needs a process group, in fp32 unless the CPU computes bf16
natively (AVX512-BF16 / AMX). Each run is a fresh process (its peak memory is its own) and the runs
are launched alternately: repeat 1 of every engine and placement, then repeat 2, and so on, so a
drift of the machine spreads over all of them. A run's figure is the median s/step of `--steps`
steps after `--warmup`; the table holds the median over `--repeats`. Engines that are not
installed, or cannot hold a placement, are listed as skipped with the reason.

  python benchmarks/vs_peers.py --preset tiny --repeats 3 --out vs_peers.json
  python benchmarks/vs_peers.py --preset 1b --seq 2048 --batch 4 --placements device,opt-host,host

Prints one JSON object: the machine, the arguments, and per (engine, placement) the median s/step,
TFLOP/s, peak GPU memory, peak RSS, bytes moved per step between host and device and to/from NVMe
(zeroinf counts them; the others report null), losses, and every repeat.
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
ENGINES = ("plain", "zeroinf", "fsdp2", "deepspeed")
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


def skip_reason(engine: str, placement: str, cuda: bool) -> str | None:
    """Why `engine` cannot run `placement` here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install transformers)"
    if engine == "plain" and placement != "device":
        return "plain PyTorch keeps everything on the device"
    if engine == "fsdp2":
        if importlib.util.find_spec("torch.distributed.fsdp") is None:
            return "this PyTorch has no torch.distributed.fsdp"
        if placement == "opt-host":
            return "FSDP2 offloads parameters, gradients and optimizer states together (placement host)"
        if placement == "nvme":
            return "FSDP2 has no NVMe tier"
    if engine == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed"
        if not cuda:
            return "DeepSpeed's ZeRO needs a CUDA device here"
    return None


# -- one run (a worker process) ----------------------------------------------------------------------------
def llama(preset: str, seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, n, ffn, heads, kv, vocab = PRESETS[preset]
    cfg = LlamaConfig(
        hidden_size=h, num_hidden_layers=n, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=max(seq, 128),
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def tokens(vocab: int, batch: int, seq: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def join_world_of_one(device: torch.device) -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def setup(a: argparse.Namespace, device: torch.device, dtype: torch.dtype, model: Any) -> tuple[Any, Any]:
    """(step(x) -> loss, zeroinf-sharded module or None) for engine `a.engine` at `a.placement`."""
    low = dtype != torch.float32
    if a.engine == "plain":
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)

        def plain_step(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=dtype, enabled=low):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return plain_step, None
    if a.engine == "zeroinf":
        import zeroinf

        params, optimizer, gradients = ZEROINF_TIERS[a.placement]
        offload = zeroinf.OffloadConfig(params=params, optimizer=optimizer, gradients=gradients, nvme_dir=a.nvme_dir)
        cfg = zeroinf.Config(stage=3, param_dtype="bf16" if low else "fp32", offload=offload)
        sharded = zeroinf.shard(model, cfg, zeroinf.Topology.single(device))
        zopt = zeroinf.AdamW(sharded, lr=1e-4, weight_decay=0.0)

        def zeroinf_step(x: torch.Tensor) -> torch.Tensor:
            loss = sharded(input_ids=x, labels=x).loss
            zopt.backward(loss)
            zopt.step()
            zopt.zero_grad()
            return loss

        return zeroinf_step, sharded
    join_world_of_one(device)
    if a.engine == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
        if a.placement == "host":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        if a.placement == "device":
            model.to(device)
        fopt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")

        def fsdp2_step(x: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            fopt.step()
            fopt.zero_grad(set_to_none=True)
            return loss

        return fsdp2_step, None
    import deepspeed

    zo: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9}
    if a.placement in ("opt-host", "host"):
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if a.placement == "host":
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    if a.placement == "nvme":
        for kind in ("offload_optimizer", "offload_param"):
            zo[kind] = {"device": "nvme", "nvme_path": a.nvme_dir, "pin_memory": True}
    ds = {
        "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": low},
        "zero_optimization": zo, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def deepspeed_step(x: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=x, labels=x).loss
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
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = llama(a.preset, a.seq)
    n_params = sum(p.numel() for p in model.parameters())
    vocab, layers, hidden = model.config.vocab_size, model.config.num_hidden_layers, model.config.hidden_size
    step, sharded = setup(a, device, dtype, model)
    times, losses, nvme_after_warmup = [], [], 0
    for i in range(a.warmup + a.steps):
        x = tokens(vocab, a.batch, a.seq, i, device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = float(step(x).detach().float())
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        elif sharded is not None:
            nvme_after_warmup = moved_bytes(sharded)["nvme"]
        losses.append(round(loss, 5))
    s_per_step = statistics.median(times)
    flops_per_token = 6 * n_params + 12 * layers * hidden * a.seq
    moved = moved_bytes(sharded) if sharded is not None else None
    return {
        "s_per_step": s_per_step,
        "tflops": flops_per_token * a.batch * a.seq / s_per_step / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "host_device_bytes_per_step": moved["host_device"] if moved else None,
        "nvme_bytes_per_step": (moved["nvme"] - nvme_after_warmup) / a.steps if moved else None,
        "losses": losses,
        "n_params": n_params,
    }


# -- the side by side (the parent process) ------------------------------------------------------------------
def launch(a: argparse.Namespace, engine: str, placement: str, dtype: str, nvme_dir: str) -> dict[str, Any]:
    argv = [
        sys.executable, os.path.abspath(__file__), "--worker", "--engine", engine, "--placement", placement,
        "--dtype", dtype, "--preset", a.preset, "--seq", str(a.seq), "--batch", str(a.batch),
        "--steps", str(a.steps), "--warmup", str(a.warmup), "--nvme-dir", nvme_dir,
    ]
    env = dict(os.environ)
    if engine == "deepspeed" and torch.cuda.is_available():  # its op builder fails on arch strings like "9.0a"
        major, minor = torch.cuda.get_device_capability(0)
        env.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    shutil.rmtree(nvme_dir, ignore_errors=True)
    os.makedirs(nvme_dir)
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.run_timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {a.run_timeout_s} s"}
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit code {done.returncode}: " + " | ".join(tail)}


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
        "host_device_bytes_per_step": median_run["host_device_bytes_per_step"],
        "nvme_bytes_per_step": median_run["nvme_bytes_per_step"],
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
            reason = skip_reason(engine, placement, cuda)
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
                    print(f"[repeat {repeat + 1}/{a.repeats}] {engine:9s} {placement:8s} {shown}", file=sys.stderr)
    results.update({key: summarize(r) for key, r in runs.items()})
    return {
        "machine": {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cpus": os.cpu_count(),
            "torch": torch.__version__, "backend": "nccl" if cuda else "gloo", "dtype": dtype,
        },
        "args": {k: v for k, v in vars(a).items() if k not in ("worker", "engine", "placement")},
        "results": [{"engine": e, "placement": p, **results[(e, p)]} for p in placements for e in engines],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
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
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--placement", choices=PLACEMENTS, help=argparse.SUPPRESS)
    p.add_argument("--nvme-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
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
