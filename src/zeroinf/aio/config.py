"""AioConfig: the knobs of the asynchronous I/O engine. It lives in zeroinf.config (a field of
`OffloadConfig`, table `[offload.aio]`) so a training config carries it; re-exported here."""

from zeroinf.config import MIB, AioConfig

__all__ = ["MIB", "AioConfig"]
