"""Weights from files: safetensors folders in the Hugging Face layout, read shard by shard."""

from zeroinf.weights.safetensors_folder import SafetensorsFolder, WeightsError

__all__ = ["SafetensorsFolder", "WeightsError"]
