"""Tiers: where a shard lives (device, host, nvme) and how it moves between them."""
