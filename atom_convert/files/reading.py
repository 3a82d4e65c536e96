"""Files read whole, safely: the JSON files of SRC (config.json, the index) and the small state files
the tool keeps (its lock, the resume journal, the demo's marker, the cache's record).

A path is read only when it is a regular file: it is opened without blocking and checked with
fstat before a byte is read (a FIFO would hold open(2) until a writer comes, for ever; a device such
as /dev/zero never ends), and at most `limit` bytes of it are read. JSON is parsed with no key twice
(`no_duplicates`), and nesting deeper than Python's parser takes (a RecursionError inside `json`) is
reported as invalid JSON, like any other malformed text, through `loads`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInputError, CheckpointError

MAX_JSON_BYTES = 256 << 20  # far above any index (DeepSeek-V3's is 9 MB) or config

# error(problems, what to do) -> the exception raised for a malformed file
ErrorFactory = Callable[[list[str], str], BadInputError]


class SpecialFileError(OSError):
    """A path that is no regular file (a device, FIFO or socket), refused before it is read."""


class FileTooLargeError(OSError):
    """A file larger than its reader's limit, refused before it is read."""


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file. The open does not block
    (O_NONBLOCK: a FIFO has no writer); IsADirectoryError or SpecialFileError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        if not stat.S_ISREG(mode):
            raise SpecialFileError(errno.EINVAL, "not a regular file (a device, FIFO or socket)", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (FileTooLargeError beyond)."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise FileTooLargeError(errno.EFBIG, f"{size} bytes, more than the {limit} this reader takes", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while it was read
        raise FileTooLargeError(errno.EFBIG, f"more than the {limit} bytes this reader takes", str(path))
    return data


def os_error(path: Path, e: OSError) -> BadInputError:
    """An OSError met reading `path` as a BadInputError that says what to do."""
    if isinstance(e, PermissionError):
        return BadInputError(f"{path}: permission denied while reading it; make it readable by this user "
                             f"(e.g. chmod a+r) or run as its owner")
    if isinstance(e, IsADirectoryError):
        return BadInputError(f"{path}: is a directory, expected a file")
    if isinstance(e, SpecialFileError):
        return BadInputError(f"{path}: is not a regular file (a device, FIFO or socket), expected a file; "
                             f"replace it with the file itself")
    if isinstance(e, FileTooLargeError):
        return BadInputError(f"{path}: {e.strerror}; it is not the file expected here, replace it with that file")
    return BadInputError(f"{path}: cannot be read ({e.strerror or e}); check the file and the disk")


def no_duplicates(where: str, error: ErrorFactory = CheckpointError,
                  hint: str = "Remove the duplicate (the file is damaged or hand-edited).") -> Any:
    """json object_pairs_hook: Python keeps the last of two equal keys silently; a header or
    config with one key twice is ambiguous (which tensor is meant?), so it is refused."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise error([f"{where}: key {k!r} appears twice in one JSON object; which one is meant is "
                             f"ambiguous"], hint)
            out[k] = v
        return out

    return hook


def loads(text: str | bytes, **kw: Any) -> Any:
    """json.loads, with nesting too deep for the parser raised as ValueError (as any malformed
    JSON is: json.JSONDecodeError is one) instead of RecursionError."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def load_json(path: Path, what: str) -> Any:
    """Parse a JSON file of SRC, refusing duplicate keys; errors name the file."""
    try:
        text = read_regular(path)
    except OSError as e:
        raise os_error(path, e) from None
    try:
        return loads(text, object_pairs_hook=no_duplicates(str(path)))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
