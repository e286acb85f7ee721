"""Demo models used by `zeroinf train`, the tests and the benchmarks."""

from zeroinf.models.gpt import GPT, PRESETS, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS"]
