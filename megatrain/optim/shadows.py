"""Weight shadows: low-precision copies of parameters that every host update keeps current.

Why: with option ``weight_shadow`` (bf16 only) the runtime streams each weight from a
page-locked bf16 copy, 2 bytes a parameter instead of the fp32 master's 4. The copy is
written by the host update itself (functional.adamw_ casts each chunk right after
updating it), so only the optimizer knows whether it is still current: it owns one
:class:`Shadows`, and ``AdamW.keep_shadows`` / ``has_shadow`` / ``shadow_sources`` are
its public face.

When a shadow may be trusted: it records, each time it is written, the parameter's
version counter and AdamW step count. It is current only while both are unchanged since:
anything else writing the parameter (load_state_dict, a device-site update's copy back, a
resident region coming home, a user's in-place write under no_grad) moves the version, an
update that did not write the shadow moves the step. A write through ``p.data`` moves
neither and is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


class Shadows:
    """Per parameter its shadow and what it was last written at (see the module docstring).
    ``state`` arguments are the optimizer's ``state`` (passed in, not kept: load_state_dict
    replaces it). Marks are written by the host worker after an update and read by the
    caller after waiting for it."""

    def __init__(self) -> None:
        self._of: dict[Tensor, Tensor] = {}  # param -> its low-precision copy
        self._marks: dict[Tensor, tuple[int, float]] = {}  # param -> (version, step) written at

    def __bool__(self) -> bool:
        return bool(self._of)

    def __contains__(self, p: Tensor) -> bool:
        return p in self._of

    def get(self, p: Tensor) -> Tensor | None:
        return self._of.get(p)

    def keep(
        self,
        params: list[Tensor],
        shadows: Sequence[Tensor],
        state: Mapping[Tensor, Any],
        describe: Callable[[Tensor], str],
    ) -> None:
        """Write each shadow from its parameter now and keep it (the caller waited for
        queued work on ``params``)."""
        with torch.no_grad():
            for p, sh in zip(params, shadows):
                if sh.shape != p.shape or not sh.is_contiguous():
                    raise ValueError(f"keep_shadows(): the shadow of {describe(p)} must be "
                                     f"contiguous and shaped {tuple(p.shape)}, not {tuple(sh.shape)}")
                sh.copy_(p)
                self._of[p] = sh
        self.mark(params, state)

    def sources(self, params: Sequence[Tensor], state: Mapping[Tensor, Any]) -> list[Tensor] | None:
        """The current shadows of all of ``params``, or None where any is missing or stale."""
        out = []
        for p in params:
            sh = self._of.get(p)
            if sh is None or self._marks.get(p) != self._mark_of(p, state):
                return None
            out.append(sh)
        return out

    def mark(self, params: Iterable[Tensor], state: Mapping[Tensor, Any]) -> None:
        """The shadows of ``params`` were just written from them (worker, or caller)."""
        for p in params:
            if p in self._of:
                self._marks[p] = self._mark_of(p, state)

    @staticmethod
    def _mark_of(p: Tensor, state: Mapping[Tensor, Any]) -> tuple[int, float]:
        st = state.get(p)
        return p._version, float(st["step"]) if st and "step" in st else 0.0
