"""zeroinf: ZeRO stages 1-3 and ZeRO-Infinity offload for ordinary PyTorch training loops.

    cfg = zeroinf.Config(stage=3, param_dtype="bf16")
    with zeroinf.init(cfg):                      # optional: each built parameter keeps 1/world on its tier
        model = MyModel()
    model = zeroinf.shard(model, cfg)            # units, hooks, shards; the module keeps its class
    opt = zeroinf.AdamW(model, lr=3e-4)          # torch.optim.Optimizer protocol
    zeroinf.plan("path/to/hf-model", cfg)        # before all that: memory per tier and step time of each placement
    for batch in loader:
        loss = model(batch); opt.backward(loss); opt.step(); opt.zero_grad()
"""

from zeroinf.checkpoint import CheckpointError, consolidate, load, save
from zeroinf.comm import CollectiveError
from zeroinf.config import Config, ConfigError, LossScaleConfig, OffloadConfig
from zeroinf.deepspeed_optimizer import optimizer_from_deepspeed
from zeroinf.ema import ema_update
from zeroinf.engine import engine_of, memory_report, shard
from zeroinf.memory import Ledger, Tier
from zeroinf.optim.adamw import Adam, AdamW
from zeroinf.optim.full_state import optimizer_state, set_optimizer_state
from zeroinf.optim.lion import Lion
from zeroinf.optim.torch_format import full_optimizer_state_dict, load_full_optimizer_state_dict
from zeroinf.optim.torch_optimizer import ShardedOptimizer
from zeroinf.partition.gathered import gathered
from zeroinf.partition.init import init
from zeroinf.planner.api import plan
from zeroinf.pretrained import from_pretrained
from zeroinf.tiling import TiledLinear, tile_linears
from zeroinf.topology import Topology, init_distributed
from zeroinf.weights.load import load_weights
from zeroinf.weights.save import save_pretrained

__all__ = [
    "Adam",
    "AdamW",
    "CheckpointError",
    "CollectiveError",
    "Config",
    "ConfigError",
    "Ledger",
    "Lion",
    "LossScaleConfig",
    "OffloadConfig",
    "ShardedOptimizer",
    "Tier",
    "TiledLinear",
    "Topology",
    "consolidate",
    "ema_update",
    "engine_of",
    "from_pretrained",
    "full_optimizer_state_dict",
    "gathered",
    "init",
    "init_distributed",
    "load_full_optimizer_state_dict",
    "load_weights",
    "load",
    "memory_report",
    "optimizer_from_deepspeed",
    "optimizer_state",
    "plan",
    "save",
    "save_pretrained",
    "set_optimizer_state",
    "shard",
    "tile_linears",
]
