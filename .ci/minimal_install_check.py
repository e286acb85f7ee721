"""Run by .ci/minimal_install in a fresh venv holding only torch and `pip install .` (no extras).

Trains a tiny model a step with everything on NVMe, saves, loads into a fresh model, consolidates,
and reads the consolidated safetensors back by hand, with Adam's moments in fp32 and in bf16: every
run-time feature of the package must work without the test extras (numpy, safetensors,
transformers), which this checks are absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
import tempfile

import torch

import zeroinf
from zeroinf.models.gpt import GPT, PRESETS


def build(swap: str, moments: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=swap,
                                    moment_dtype=moments)
    model = zeroinf.shard(GPT(PRESETS["tiny"]), zeroinf.Config(stage=3, offload=offload, persist_threshold_bytes=0))
    return model, zeroinf.AdamW(model, lr=1e-3)


def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """The consolidated tensors, parsed from the format itself (8-byte header size, JSON, data)."""
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        data = open(os.path.join(folder, fname), "rb").read()
        (header_bytes,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_bytes])
        body = bytearray(data[8 + header_bytes :])
        for name, meta in header.items():
            if name != "__metadata__":
                a, b = meta["data_offsets"]
                out[name] = torch.frombuffer(body[a:b], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
    return out


def main() -> int:
    extras = [m for m in ("numpy", "safetensors", "transformers") if importlib.util.find_spec(m) is not None]
    if extras:
        print(f"minimal install check: {extras} installed, so this venv is not a minimal install", file=sys.stderr)
        return 1
    for moments in ("fp32", "bf16"):
        count = round_trip(moments)
    print(f"minimal install check: saved, loaded and consolidated {count} tensors (zeroinf {zeroinf.__file__})")
    return 0


def round_trip(moments: str) -> int:
    with tempfile.TemporaryDirectory(prefix="zeroinf-minimal-") as tmp:
        swap, ckpt, out = (os.path.join(tmp, name) for name in ("swap", "ckpt", "consolidated"))
        model, opt = build(swap, moments)  # the swap folder is missing: it is created
        x = torch.randint(0, 256, (2, 32))
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()
        zeroinf.save(ckpt, model, opt, step=1)
        saved = {k: v.float().clone() for k, v in model.state_dict().items()}
        opt.close()
        zeroinf.engine_of(model).close()

        model, opt = build(swap, moments)
        info = zeroinf.load(ckpt, model, opt)
        loaded = model.state_dict()
        assert info["step"] == 1, info
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name].float(), value, rtol=0, atol=0, msg=f"loaded {name}")
        zeroinf.consolidate(ckpt, out, dtype="fp32")
        weights = read_safetensors(out)
        assert set(weights) == set(saved), (sorted(weights), sorted(saved))
        for name, value in saved.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=f"consolidated {name}")
        opt.close()
        zeroinf.engine_of(model).close()
    return len(weights)


if __name__ == "__main__":
    sys.exit(main())
