"""Where each parameter of a region sits inside one flat buffer.

Host store and device buffer share the layout, so a region crosses PCIe as one copy.
Offsets are padded to 64 elements so every view starts 128-byte aligned (bf16) or
256-byte aligned (fp32), which Triton and cuBLAS want.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_ELEMENTS = 64


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class FlatLayout:
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @staticmethod
    def of(shapes) -> "FlatLayout":
        offsets, cursor = [], 0
        shapes = tuple(torch.Size(s) for s in shapes)
        for s in shapes:
            offsets.append(cursor)
            cursor += _round_up(max(s.numel(), 1), ALIGN_ELEMENTS)
        return FlatLayout(shapes, tuple(offsets), cursor)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]


def _adjacent(a: torch.Tensor, b: torch.Tensor, delta: int) -> bool:
    return (a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() - a.data_ptr() == delta * a.element_size())


def contiguous_spans(tensors, layout: FlatLayout) -> list[tuple[int, int, torch.Tensor]]:
    """Group tensors that already sit in host memory exactly as `layout` places them.

    Returns (flat_offset, numel, source) triples; each source is one 1-D tensor, so a
    region homed by the host store is a single copy (padding included).
    """
    spans = []
    i, n = 0, len(tensors)
    while i < n:
        j = i + 1
        while j < n and _adjacent(tensors[i], tensors[j], layout.offsets[j] - layout.offsets[i]):
            j += 1
        base = tensors[i]
        if j - i == 1:
            spans.append((layout.offsets[i], base.numel(), base.reshape(-1)))
        else:
            length = layout.offsets[j - 1] - layout.offsets[i] + tensors[j - 1].numel()
            spans.append((layout.offsets[i], length,
                          base.as_strided((length,), (1,), base.storage_offset())))
        i = j
    return spans
