"""Optimizers over shards."""
