"""Adam's moments held in bf16 (`offload.moment_dtype = "bf16"`): the update in an fp32 window,
then stochastic rounding back to bf16.

[Note: bf16 moments]
The fp32 master and two fp32 moments are 12 bytes per parameter, the largest part of a full
fine-tune's memory (and, on NVMe, of its disk and of the bytes swapped every step). Keeping the
moments in bf16 makes it 8. The update itself still runs in fp32: each piece of the moments is
widened into an fp32 window, PyTorch's fused AdamW kernel updates master and window as it would
fp32 states, and the window is rounded back.

Rounding to nearest would not do: with beta2 = 0.999 each step changes the second moment by 0.1%
of itself, less than half of bf16's 2^-8 relative spacing, so a rounded `v` would stop decaying
(and stop growing while gradients are small) and the step size would drift. Stochastic rounding
rounds up with probability equal to the distance from the lower neighbour, so every rounding is
unbiased and a small change survives in expectation: add 16 random bits to the fp32 bit pattern,
then clear the low 16 bits (`round_stochastic_`). Adding to the pattern works for both signs (the
magnitude grows by less than one bf16 step, the truncation rounds it back down or not); a carry
into the exponent lands exactly on the next binade's first value, which is the round-up.

The random bits come from a fixed table (`NoiseTable`), not from a generator: drawing 16 bits per
element each step cost more than the AdamW kernel on a CPU (4.7 ns against 0.46 per element, 2
threads). The bits for element j of a parameter at its Adam step t are the table's entry
`(crc32(name) + j + t * STEP_STRIDE + moment * PERIOD / 2) mod PERIOD`: a contiguous slice for a
contiguous piece, and the same whatever the sharding, the world size, the unit and sub-group cuts
or the tier, so every placement trains bitwise the same with bf16 moments, and a plain loop over
`named_parameters()` reproduces it (tests/optim/test_moment_dtype.py). The stride is coprime with
the period, so each element walks the whole table over PERIOD steps: its rounding noise is uniform.
The table's size matters: each step, neighbouring elements take neighbouring entries, so one table
shifts the whole tensor's roundings together, by that table's luck. A second moment decayed 2000
times by 0.999 (4096 elements) ended 0.3-1.0% off its expected mean with tables of 2^18 entries
(six seeds), within 0.3% with 2^22, as with fresh random bits for every element and step (0.2%).

Cost (AMD EPYC, 2 threads, 64M elements in RAM, these operations timed alone): 0.97 ns per element
against 0.46 for fp32 moments (widening 0.16, rounding 0.26, narrowing 0.16; in the engine, a 201M
optimizer step with host states: 1.7x, benchmarks/optimizer_tiers.py); the window (`WINDOW_NUMEL` elements, two
fp32 buffers of 4 MiB each per device, allocated once) keeps the widened moments in cache, so the
DRAM traffic is 20 bytes per element instead of 28. Where the states stream from NVMe, the 8 bytes
per element fewer to read and write are what counts.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.optim.adamw import adamw as functional_adamw

from zeroinf.memory import Ledger, Tier
from zeroinf.partition.flat_buffer import ALIGN_NUMEL

PERIOD = 1 << 22  # entries of the noise table (16 MiB of int32; see the note on its size)
WINDOW_NUMEL = 1 << 20  # most moment elements widened to fp32 at once
STEP_STRIDE = 104_729  # a prime: coprime with PERIOD
_SEED = 0x5EED_B16
_LOW_BITS = 1 << 16  # the fp32 mantissa bits a bf16 value drops
_HIGH_MASK = -_LOW_BITS  # 0xFFFF0000 as int32
WINDOW_TAG = "optimizer_window"  # ledger tag of the step's fp32 windows and noise table


def window_numel(largest_sub_group: int) -> int:
    """Elements of each fp32 window: WINDOW_NUMEL, or the largest sub-group when smaller."""
    return max(1, min(WINDOW_NUMEL, largest_sub_group))


def window_bytes(largest_sub_group: int) -> int:
    """Memory of the two fp32 windows and the noise table, where the update runs."""
    n = window_numel(largest_sub_group)
    return 2 * 4 * n + 4 * (PERIOD + n)


def param_key(name: str) -> int:
    """A parameter's offset into the noise table, from its name (the same on every rank and layout)."""
    return zlib.crc32(name.encode()) % PERIOD


def noise_index(key: int, start: int, step: int, moment: int) -> int:
    """The table entry of element `start` of the parameter with `key`, at Adam step `step` (1 for the
    first update), for moment 0 (exp_avg) or 1 (exp_avg_sq)."""
    return (key + start + step * STEP_STRIDE + moment * (PERIOD // 2)) % PERIOD


def round_stochastic_(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Make the fp32 tensor `x` hold bf16 values, each rounded up with probability equal to its
    distance from the bf16 value below (in magnitude): `noise` holds uniform integers in [0, 2^16)."""
    bits = x.view(torch.int32)
    bits.add_(noise)
    bits.bitwise_and_(_HIGH_MASK)
    return x


class NoiseTable:
    """The table of 16-bit random integers, periodic, long enough for a slice of `window` elements."""

    def __init__(self, device: torch.device, window: int = WINDOW_NUMEL) -> None:
        generator = torch.Generator().manual_seed(_SEED)
        head = torch.randint(0, _LOW_BITS, (PERIOD,), dtype=torch.int32, generator=generator)
        reps = -(-(PERIOD + window) // PERIOD)
        self.values = head.repeat(reps)[: PERIOD + window].to(device)

    def slice(self, key: int, start: int, step: int, moment: int, numel: int) -> torch.Tensor:
        """The noise of elements [start, start + numel) (numel at most the table's window)."""
        first = noise_index(key, start, step, moment)
        return self.values[first : first + numel]

    def of(self, key: int, numel: int, step: int, moment: int) -> torch.Tensor:
        """The noise of a whole parameter of `numel` elements (any size; a reference loop's view)."""
        first = noise_index(key, 0, step, moment)
        index = (torch.arange(numel, device=self.values.device) + first) % PERIOD
        return self.values[index]


class Piece(NamedTuple):
    """One parameter's range of a sub-group, as the bf16 step takes it."""

    master: torch.Tensor  # fp32, updated in place
    grad: torch.Tensor  # fp32
    exp_avg: torch.Tensor  # bf16, updated in place
    exp_avg_sq: torch.Tensor  # bf16, updated in place
    key: int  # `param_key` of the parameter
    start: int  # index of the piece's first element in the parameter
    step: int  # the parameter's Adam steps before this one


class Bf16MomentStep:
    """The fused AdamW step over pieces with bf16 moments. Its two fp32 windows, step scalars and
    noise table are made at the first update, where the states are updated (on the ledger's `tier`),
    and kept (a steady step allocates nothing)."""

    def __init__(self, ledger: Ledger, tier: Tier, largest_sub_group: int = WINDOW_NUMEL) -> None:
        self.ledger, self.tier = ledger, tier
        self.window = window_numel(largest_sub_group)
        self._windows: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._noise: dict[torch.device, NoiseTable] = {}
        self._steps: dict[torch.device, list[torch.Tensor]] = {}

    def _window(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        window = self._windows.get(device)
        if window is None:
            window = self._windows[device] = (
                torch.empty(self.window, dtype=torch.float32, device=device),
                torch.empty(self.window, dtype=torch.float32, device=device),
            )
            self._noise[device] = NoiseTable(device, self.window)
            self._steps[device] = []
            self.ledger.reserve(self.tier, window_bytes(self.window), WINDOW_TAG)
        return window

    def close(self) -> None:
        """Free the windows (the optimizer's close)."""
        if self._windows:
            self.ledger.release(self.tier, window_bytes(self.window) * len(self._windows), WINDOW_TAG)
        self._windows.clear()
        self._noise.clear()
        self._steps.clear()

    def _step_tensors(self, device: torch.device, n: int) -> list[torch.Tensor]:
        tensors = self._steps[device]
        while len(tensors) < n:
            tensors.append(torch.zeros((), dtype=torch.float32, device=device))
        return tensors[:n]

    def step(self, pieces: Sequence[Piece], *, lr: float, beta1: float, beta2: float, weight_decay: float,
             eps: float, update: Callable[..., None] = functional_adamw) -> None:
        """One update of every piece (one param group's hyperparameters): torch's AdamW, or `update`
        with its signature (torch's Adam)."""
        if not pieces:
            return
        device = pieces[0].master.device
        m_window, v_window = self._window(device)
        noise = self._noise[device]
        for window in _windows(pieces, self.window):
            m32s, v32s, offset = [], [], 0
            for p in window:
                n = p.master.numel()
                m32s.append(m_window[offset : offset + n].copy_(p.exp_avg))
                v32s.append(v_window[offset : offset + n].copy_(p.exp_avg_sq))
                offset += n
            steps = self._step_tensors(device, len(window))
            for t, p in zip(steps, window, strict=True):
                t.fill_(float(p.step))
            update(
                [p.master for p in window], [p.grad for p in window], m32s, v32s, [], steps,
                fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
                eps=eps, maximize=False,
            )
            for p, m32, v32 in zip(window, m32s, v32s, strict=True):
                n = m32.numel()
                p.exp_avg.copy_(round_stochastic_(m32, noise.slice(p.key, p.start, p.step + 1, 0, n)))
                p.exp_avg_sq.copy_(round_stochastic_(v32, noise.slice(p.key, p.start, p.step + 1, 1, n)))


def _windows(pieces: Sequence[Piece], size: int) -> list[list[Piece]]:
    """The pieces in groups of at most `size` elements, a larger piece cut into several, each cut on a
    multiple of 64 of the parameter's elements where the window allows (partition/flat_buffer.py
    [Note: why every parameter starts on 64 elements])."""
    out: list[list[Piece]] = [[]]
    room = size
    for p in pieces:
        done = 0
        numel = p.master.numel()
        while done < numel:
            if room == 0:
                out.append([])
                room = size
            take = min(room, numel - done)
            if take < numel - done:
                aligned = (p.start + done + take) // ALIGN_NUMEL * ALIGN_NUMEL - p.start - done
                if aligned > 0:
                    take = aligned
                elif room < size:  # no aligned cut fits what is left of this window: the next one
                    room = 0
                    continue
                # (a window under 64 elements cuts where it must)
            part = slice(done, done + take)
            out[-1].append(Piece(
                p.master[part], p.grad[part], p.exp_avg[part], p.exp_avg_sq[part], p.key, p.start + done, p.step,
            ))
            done += take
            room -= take
    return [w for w in out if w]
