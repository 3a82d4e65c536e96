"""Error types. Every user-facing failure is an `AtomConvertError`.

`BadInputError` (exit code 2) covers everything the user can fix: a missing or
malformed tensor, an unsupported format, an existing destination. Its message
names the file and tensor, the expected and the actual value, and what to do.
Anything else that escapes is an internal error (exit code 1).
"""

from __future__ import annotations

from typing import Any


def json_kind(v: Any) -> str:
    """A JSON value's type as a user reads it in a message: 'a list', 'null', 'a string'."""
    if v is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(v), type(v).__name__)


def json_found(obj: dict[str, Any], key: str, n: int = 80) -> str:
    """What `obj[key]` is, for a message: 'missing', 'null', or its kind and value ('a string 'x'')."""
    if key not in obj:
        return "missing"
    v = obj[key]
    if v is None:
        return "null"
    r = repr(v)
    return f"{json_kind(v)} {r if len(r) <= n else r[: n - 3] + '...'}"


def _rebuild(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> Exception:
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e


class AtomConvertError(Exception):
    """Base class of atom-convert's own errors."""

    exit_code = 1

    def __reduce__(self) -> Any:
        # Pickled as they are (a worker process reports its error to the converting process,
        # procs.py): the message and attributes as raised, not re-run through a subclass's
        # __init__ (CheckpointError would wrap its own message a second time).
        return _rebuild, (type(self), self.args, self.__dict__)


class BadInputError(AtomConvertError):
    """The input (checkpoint, options or destination) cannot be converted as given."""

    exit_code = 2


class UnsupportedError(BadInputError):
    """A valid checkpoint that atom-convert (or ATOM) does not support."""


_ESCAPED = {c: chr(c).encode("unicode_escape").decode() for c in (*range(32), 127)}


class CheckpointError(BadInputError):
    """The source checkpoint is incomplete, truncated or inconsistent.

    `problems` lists every problem found, not only the first one, so that a user
    can fix a checkpoint in one pass.
    """

    def __init__(self, problems: list[str] | str, hint: str | None = None):
        if isinstance(problems, str):
            problems = [problems]
        # one line each: a control character a name carries (a tensor named "a\nb") is shown escaped
        self.problems = [p.translate(_ESCAPED) for p in problems]
        shown = self.problems[:20]
        text = "\n".join(f"  - {p}" for p in shown)
        if len(self.problems) > len(shown):
            text += f"\n  ... and {len(self.problems) - len(shown)} more"
        msg = f"invalid source checkpoint ({len(self.problems)} problem(s)):\n{text}"
        if hint:
            msg += f"\n{hint}"
        super().__init__(msg)


class ConfigError(CheckpointError):
    """config.json (or its quantization_config) holds a value of the wrong type or range.

    Each problem names the key, the expected type or range and the value found.
    """

    def __init__(self, problems: list[str] | str, hint: str | None = None):
        super().__init__(problems, hint or "Fix config.json; the values of the original release are in its model card.")


class DestinationExistsError(BadInputError):
    """The destination exists and `force` was not given."""


class NotResumableError(BadInputError):
    """A partial conversion beside DST was staged from another source, other options or another
    build, so it cannot be resumed (`resume="restart"` discards it)."""


class HubOfflineError(BadInputError):
    """A Hub repo was needed while offline (HF_HUB_OFFLINE=1 or the Hub unreachable) and the local
    Hugging Face cache cannot answer for it."""


class ConvertedCheckError(BadInputError):
    """A converted directory fails its integrity checks."""


class VerificationFailedError(AtomConvertError):
    """A verification that ran to its end and found problems (`atom-convert verify`, the demo's
    last step): exit code 3, distinct from bad input (2) and an internal error (1). The report
    (every problem) has been printed before it is raised."""

    exit_code = 3


class Interrupted(KeyboardInterrupt):
    """A conversion stopped by SIGINT (Ctrl-C) or SIGTERM.

    A KeyboardInterrupt, so that code which handles Ctrl-C handles SIGTERM alike. Raised by
    the CLI's SIGTERM handler (bare, `message` empty) and re-raised by `convert` once it has
    cleaned up, with a message saying what was kept and how to resume. `exit_code` is the
    shell's convention, 128 + the signal number: 130 for SIGINT, 143 for SIGTERM.
    """

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
