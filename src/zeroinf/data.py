"""The training corpus and its batches, for the byte-level demo model of `zeroinf train`.

The default corpus needs no download: the Python standard library's own `.py` files, read at run
time as bytes. Users may pass text files of their own instead.

Batches are a pure function of `(seed, step)`: every rank draws the same global batch of random
windows and takes its contiguous slice, so a single process reproduces the global batch of any world
size exactly (that is how the parity tests compare world sizes). Layout of one global batch:

    [ rank 0: micro 0 | micro 1 | ... ][ rank 1: micro 0 | ... ] ...   (global_batch sequences)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "turtledemo"}
)
"""Folders of the standard library left out of the default corpus (third-party code, test data)."""

DEFAULT_MAX_CORPUS_BYTES = 64 * 2**20


def default_corpus_files() -> list[Path]:
    """The `.py` files of the Python standard library, sorted by path (deterministic on one install)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_STDLIB_DIRS)
        files += [Path(dirpath) / name for name in filenames if name.endswith(".py")]
    return sorted(files)


def load_corpus(paths: Sequence[str | Path] | None, max_bytes: int = DEFAULT_MAX_CORPUS_BYTES) -> torch.Tensor:
    """The bytes of `paths` (the default corpus when None or empty), concatenated in order.

    Returns a 1-D uint8 tensor of at most `max_bytes` bytes. Raises `FileNotFoundError` naming a
    missing file and `ValueError` when the corpus turns out empty.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes = {max_bytes} is invalid: use a positive byte count")
    user_given = bool(paths)
    files = [Path(p) for p in paths] if paths else default_corpus_files()
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist (or is not a regular file)")
    chunks: list[bytes] = []
    total_bytes = 0
    for path in files:
        with path.open("rb") as file:
            chunk = file.read(max_bytes - total_bytes)
        chunks.append(chunk)
        total_bytes += len(chunk)
        if total_bytes >= max_bytes:
            break
    if total_bytes == 0:
        where = "the given files" if user_given else f"the standard library at {sysconfig.get_paths()['stdlib']}"
        raise ValueError(f"the corpus is empty: no bytes in {where}; pass non-empty text files with --data")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last `val_fraction` of the bytes is held out for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction = {val_fraction} is invalid: use a number in (0, 1)")
    n_val = max(1, int(len(data) * val_fraction))
    return data[: len(data) - n_val], data[len(data) - n_val :]


class BatchSampler:
    """Random windows of a byte corpus; one global batch per step, sliced by rank and micro-step.

    `batch(step)` is this rank's slice `(inputs, targets)`, int64 `[global_batch / world_size,
    seq_len]`, with targets the inputs shifted by one byte. `micro_batches(step)` splits that slice
    into `grad_accum_steps` pieces for gradient accumulation.
    """

    def __init__(
        self,
        data: torch.Tensor,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        grad_accum_steps: int = 1,
    ) -> None:
        if seq_len < 1 or global_batch < 1 or world_size < 1 or grad_accum_steps < 1:
            raise ValueError(
                f"seq_len ({seq_len}), global_batch ({global_batch}), world_size ({world_size}) and "
                f"grad_accum_steps ({grad_accum_steps}) must all be positive"
            )
        if global_batch % (world_size * grad_accum_steps):
            raise ValueError(
                f"global batch of {global_batch} sequences does not divide into world_size {world_size} x "
                f"grad_accum_steps {grad_accum_steps}: use a global batch that is a multiple of "
                f"{world_size * grad_accum_steps}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"the corpus has {len(data)} bytes, fewer than one sequence of seq_len + 1 = {seq_len + 1}: "
                "use more text or a shorter --seq-len"
            )
        self.data = data
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.grad_accum_steps = grad_accum_steps
        self._offsets = torch.arange(seq_len + 1)

    @property
    def rank_batch(self) -> int:
        """Sequences per rank and step."""
        return self.global_batch // self.world_size

    @property
    def micro_batch(self) -> int:
        """Sequences per rank and micro-step."""
        return self.rank_batch // self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch (all ranks, all micro-steps)."""
        return self.global_batch * self.seq_len

    def window_starts(self, step: int) -> torch.Tensor:
        """Start offsets of the `global_batch` windows of `step`; the same on every rank."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % 2**63)
        return torch.randint(0, len(self.data) - self.seq_len, (self.global_batch,), generator=generator)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contiguous slice of the global batch of `step`: (inputs, targets)."""
        starts = self.window_starts(step)[self.rank * self.rank_batch : (self.rank + 1) * self.rank_batch]
        windows = self.data[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of `step`, split into `grad_accum_steps` consecutive micro-batches."""
        inputs, targets = self.batch(step)
        return list(zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True))
