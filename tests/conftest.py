"""The default run is CPU-only, also on a machine with GPUs: every world-1 test, every spawned gloo
rank and every subprocess runs on the CPU (`ZEROINF_DEVICE=cpu`, inherited by child processes).
Tests marked `gpu` (`pytest -m gpu`) choose their CUDA device explicitly and skip without one."""

from __future__ import annotations

import os

from zeroinf.topology import DEVICE_ENV

os.environ[DEVICE_ENV] = "cpu"
