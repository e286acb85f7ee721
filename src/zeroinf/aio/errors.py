"""The exceptions of the I/O engine: each names the file, offset, byte count and operation."""

from __future__ import annotations

import errno as errno_codes
import os


class AioError(OSError):
    """An I/O operation did not complete: the data did not reach its file (or its buffer).

    Subclasses OSError so callers that catch OSError keep working; `errno` is set when the kernel
    gave one (ENOSPC, EIO, EFBIG, ...).
    """

    def __init__(
        self,
        op: str,
        path: str,
        offset: int,
        nbytes: int,
        reason: str,
        errno: int | None = None,
    ) -> None:
        message = f"aio {op} of {nbytes} bytes at offset {offset} in {path!r} failed: {reason}"
        super().__init__(message)
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.reason = reason
        self.errno = errno  # None means "no errno"
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across pickling (e.g. subprocesses)
        return (type(self), (self.op, self.path, self.offset, self.nbytes, self.reason, self.errno))

    @classmethod
    def from_os_error(
        cls, op: str, path: str, offset: int, nbytes: int, exc: OSError, detail: str = ""
    ) -> AioError:
        code = exc.errno
        name = errno_codes.errorcode.get(code, "?") if code is not None else "?"
        reason = f"{name}: {os.strerror(code) if code is not None else exc}"
        hint = _HINTS.get(code) if code is not None else None
        if hint:
            reason += f" ({hint})"
        if detail:
            reason += f" [{detail}]"
        return cls(op, path, offset, nbytes, reason, code)


class ShortIOError(AioError):
    """The kernel transferred fewer bytes than asked: the file ends early (truncated by someone
    else?) or the disk stopped accepting data."""


class IntegrityError(AioError):
    """Data read back does not match the checksum stored when it was written."""


class BufferPoolTimeout(TimeoutError):
    """No pool buffer was released within the timeout: the pool is too small or a holder leaked."""


_HINTS = {
    errno_codes.ENOSPC: "disk full: free space or move the swap folder",
    errno_codes.EFBIG: "file size limit reached (RLIMIT_FSIZE or the filesystem's maximum)",
    errno_codes.EIO: "device I/O error: check the disk (dmesg)",
    errno_codes.ENOENT: "the folder or file does not exist",
    errno_codes.EACCES: "permission denied: choose a writable folder",
    errno_codes.EROFS: "read-only filesystem: choose a writable folder",
    errno_codes.EINVAL: "invalid argument: misaligned O_DIRECT transfer or unsupported filesystem",
}
