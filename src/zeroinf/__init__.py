"""zeroinf: ZeRO stages 1-3 and ZeRO-Infinity offload for ordinary PyTorch training loops.

    cfg = zeroinf.Config(stage=2, param_dtype="bf16")
    model = zeroinf.shard(model, cfg)            # units, hooks, shards; the module keeps its class
    opt = zeroinf.AdamW(model, lr=3e-4)          # torch.optim.Optimizer protocol
"""

from zeroinf.config import Config, ConfigError, LossScaleConfig, OffloadConfig
from zeroinf.memory import Ledger, Tier
from zeroinf.topology import Topology, init_distributed

__all__ = [
    "Config",
    "ConfigError",
    "LossScaleConfig",
    "OffloadConfig",
    "Ledger",
    "Tier",
    "Topology",
    "init_distributed",
]

try:  # the engine lands in pieces; keep the package importable meanwhile
    from zeroinf.engine import memory_report, shard  # noqa: F401
    from zeroinf.optim.adamw import AdamW  # noqa: F401

    __all__ += ["shard", "memory_report", "AdamW"]
except ImportError:  # pragma: no cover
    pass
