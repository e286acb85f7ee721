"""Dynamic loss scaling for fp16 compute (bf16 and fp32 need none).

The scale multiplies the loss before backward; the optimizer divides it out of the gradients.
A step whose gradients overflow (inf/nan anywhere, on any rank) is skipped and the scale backs off;
after `growth_interval` clean steps it grows again.
"""

from __future__ import annotations

from typing import Any

from zeroinf.config import LossScaleConfig
from zeroinf.telemetry import get_logger

MAX_OVERFLOWS_AT_MIN_SCALE = 10


class DynamicLossScaler:
    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scale = float(cfg.initial_scale)
        self.clean_steps = 0
        self.overflows_at_min = 0
        self.skipped_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        """Record the outcome of a step: back off and log on overflow, grow after a clean interval."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.scale <= self.cfg.min_scale:
                self.overflows_at_min += 1
                if self.overflows_at_min >= MAX_OVERFLOWS_AT_MIN_SCALE:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed {self.overflows_at_min} steps in a row at the minimum loss "
                        f"scale {self.cfg.min_scale}: the model diverged or fp16 cannot represent it; "
                        "lower the learning rate or use param_dtype='bf16'"
                    )
            new_scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            get_logger().warning(
                "step %d: gradient overflow, step skipped; loss scale %g -> %g", step, self.scale, new_scale
            )
            self.scale = new_scale
            return
        self.overflows_at_min = 0
        self.clean_steps += 1
        if self.clean_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            "overflows_at_min": self.overflows_at_min,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.overflows_at_min = int(state.get("overflows_at_min", 0))
