"""User-facing errors that reach the caller unwrapped through torch.compile.

Dynamo wraps any exception a backend raises in `BackendCompilerFailed`, except its own
`ShortenTraceback` family. Our errors join that family so that a user's mistake arrives as
the ValueError/TypeError it is, naming the value and the fix.
"""

from __future__ import annotations

import contextlib

import torch._dynamo.exc as _dynamo_exc

_Passthrough = getattr(_dynamo_exc, "ShortenTraceback", Exception)


class _UserError(_Passthrough):  # type: ignore[misc, valid-type]
    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.message = message
        self.first_useful_frame = None

    def __str__(self) -> str:
        # The message is the whole story: dynamo appends a "please report this bug to
        # PyTorch" footer to the args of exceptions leaving a compile, which is not ours to
        # show (the message names the value and the fix). noting() rewrites .message.
        message = self.__dict__.get("message")
        return message if message is not None else Exception.__str__(self)

    def remove_dynamo_frames(self):  # keep the whole traceback: it is short already
        return self


class MegatrainValueError(_UserError, ValueError):
    """A value the user passed cannot work; the message names it and the fix."""


class MegatrainTypeError(_UserError, TypeError):
    """A value of the wrong kind; the message names it and the fix."""


class UnsupportedError(_UserError, NotImplementedError):
    """A construct megatrain cannot stream; the message names the op and the module."""


@contextlib.contextmanager
def noting(note: str):
    """Add `note` (when there is one) to the message of a MegatrainValueError raised in the
    block: the same exception object, so its type and attributes (a refused budget's
    `min_budget`) stay as they were."""
    try:
        yield
    except MegatrainValueError as e:
        if note:
            e.message = f"{e!s}. Note: {note}"
            e.args = (e.message, *e.args[1:])
        raise


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
