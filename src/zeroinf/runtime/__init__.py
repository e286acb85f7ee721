"""The runtime: hooks that move data as modules run."""
