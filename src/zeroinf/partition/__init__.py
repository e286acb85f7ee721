"""Units, flat buffers and shards: how parameters are grouped, laid out and split across ranks."""
