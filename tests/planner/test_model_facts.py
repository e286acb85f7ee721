"""The planner's meta-tensor pass: fused attention as on the real device, and no torch._dynamo import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from zeroinf.planner.model_facts import from_preset


def test_attention_saves_what_the_fused_kernel_saves() -> None:
    # The math kernel (what meta tensors would pick) saves the seq x seq attention matrix: the saved
    # bytes of a block would grow 4x when the sequence doubles. The CPU flash kernel's grow 2x.
    facts = from_preset("tiny", seq_len=256)
    short = facts.pass_facts(1, 128, "fp32", torch.device("cpu"))
    long = facts.pass_facts(1, 256, "fp32", torch.device("cpu"))
    assert short is not None and long is not None
    assert long.unit_saved_bytes[0] == 2 * short.unit_saved_bytes[0]


def test_the_pass_leaves_torch_dynamo_unimported_and_working() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        from zeroinf.planner.model_facts import from_preset
        assert from_preset("tiny").pass_facts(2, 64, "bf16", torch.device("cpu")) is not None
        assert not [m for m in sys.modules if m.startswith("torch._dynamo")], "the pass imported dynamo"
        import torch._dynamo
        assert torch._dynamo.disable.__module__.startswith("torch._dynamo")
        emb = torch.nn.functional.embedding(torch.zeros(2, dtype=torch.long, device="meta"),
                                            torch.empty(3, 4, device="meta"))
        assert emb.shape == (2, 4)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
