"""How parameters are split across ranks, and how a region's tensors are packed for one
collective.

Each parameter is flattened and split evenly: with ``n`` elements and ``N`` ranks every rank
has a slot of ``k = ceil(n / N)`` elements and rank ``r`` owns elements
``[r*k, min((r+1)*k, n))`` (the last ranks' slots may be short or empty; the gap is padding,
at most ``N - 1`` elements per parameter). This is FSDP2's per-parameter sharding, on the
flattened tensor rather than on dim 0, so any shape splits evenly.

The split is per parameter, not per region, so a parameter's shard (and its optimizer
state) does not depend on which region, bucket or code path hands its gradient in.

A region of parameters ``p_0..p_m`` is packed rank-major, one row per rank::

    row r = [ slot r of p_0 (k_0) | slot r of p_1 (k_1) | ... | tag ]     (K = sum k_i + 1)

so reduce-scatter of the ``N x K`` buffer leaves rank ``r`` with row ``r``: its shard of
every parameter of the region, summed over ranks, followed by the sum of the ranks' tags.
The tag identifies the region (its parameters' indices in the optimizer); if every rank
handed in the same region it sums to ``N * tag``, otherwise the ranks disagree on the order
of the regions and the run must stop rather than mix gradients of different layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatrain.memory.host_store import host_zeros

# Tags stay small so that world * tag is exact in fp32 (< 2**24) up to 2048 ranks.
_TAG_MOD = 8191


@dataclass(frozen=True)
class ShardSpec:
    """One parameter's split: ``numel`` elements over ``world`` ranks; this rank's range."""

    numel: int
    world: int
    rank: int

    @property
    def slot(self) -> int:
        """Elements per rank, padding included: ``ceil(numel / world)``."""
        return -(-self.numel // self.world)

    def range_of(self, rank: int) -> tuple[int, int]:
        lo = min(rank * self.slot, self.numel)
        return lo, min(lo + self.slot, self.numel)

    @property
    def lo(self) -> int:
        return self.range_of(self.rank)[0]

    @property
    def hi(self) -> int:
        return self.range_of(self.rank)[1]

    @property
    def size(self) -> int:
        return self.hi - self.lo


def region_tag(indices: list[int]) -> float:
    """A small integer (as a float) that differs between regions with high probability."""
    h = len(indices)
    for i in indices:
        h = (h * 1000003 + i + 1) % _TAG_MOD
    return float(h + 1)


class RegionLayout:
    """The packed form of one region: offsets of every parameter's slot in a row of K."""

    def __init__(self, specs: list[ShardSpec], tag: float) -> None:
        assert specs and len({(s.world, s.rank) for s in specs}) == 1
        self.specs = specs
        self.world, self.rank = specs[0].world, specs[0].rank
        self.tag = tag
        self.offsets: list[int] = []
        off = 0
        for s in specs:
            self.offsets.append(off)
            off += s.slot
        self.row = off + 1  # + the tag
        self.tag_checked = self.world * (_TAG_MOD + 1) < 2**24

    # ---- full tensors <-> rank-major rows -------------------------------------------

    def pack_full(self, tensors: list[Tensor], out: Tensor) -> None:
        """``out`` (world x row) := every rank's slot of each tensor, zero-padded, + tag."""
        rows = out.view(self.world, self.row)
        for t, s, off in zip(tensors, self.specs, self.offsets):
            if s.slot == 0:
                continue
            flat = t.reshape(-1)
            dst = rows[:, off:off + s.slot]
            full = s.numel // s.slot  # ranks whose slot is complete
            if full:
                dst[:full].copy_(flat[: full * s.slot].view(full, s.slot))
            if full < self.world:
                rest = s.numel - full * s.slot
                if rest:
                    dst[full, :rest].copy_(flat[full * s.slot:])
                dst[full, rest:].zero_()
                dst[full + 1:].zero_()
        rows[:, -1].fill_(self.tag)

    def unpack_full(self, rows: Tensor, tensors: list[Tensor]) -> None:
        """The inverse of :meth:`pack_full` into ``tensors`` (contiguous; padding dropped)."""
        rows = rows.view(self.world, self.row)
        for t, s, off in zip(tensors, self.specs, self.offsets):
            if s.slot == 0:
                continue
            flat = t.view(-1)
            src = rows[:, off:off + s.slot]
            full = s.numel // s.slot
            if full:
                flat[: full * s.slot].view(full, s.slot).copy_(src[:full])
            rest = s.numel - full * s.slot
            if rest:
                flat[full * s.slot:].copy_(src[full, :rest])

    # ---- this rank's row ------------------------------------------------------------

    def own(self, row: Tensor) -> list[Tensor]:
        """Views of this rank's shard of every tensor inside its row."""
        return [row[off:off + s.size] for s, off in zip(self.specs, self.offsets)]

    def pack_own(self, shards: list[Tensor], out: Tensor) -> None:
        """``out`` (row) := this rank's shards (padding left as is) + tag."""
        for dst, src in zip(self.own(out), shards):
            dst.copy_(src)
        out[-1] = self.tag

    def check_tag(self, row: Tensor, expected_sum: float, what: str) -> None:
        if not self.tag_checked:
            return
        got = float(row[-1])
        if got != expected_sum:
            raise RuntimeError(
                f"megatrain data parallel: {what}: the ranks handed different regions to the "
                f"optimizer at the same point (tag sum {got:g}, expected {expected_sum:g}). "
                "Every rank must run the same model, compiled the same way, and produce "
                "gradients for the same parameters in the same order."
            )


def own_view(param: Tensor, spec: ShardSpec) -> Tensor:
    """This rank's shard of ``param`` as a view of its (contiguous) storage."""
    return param.detach().view(-1)[spec.lo:spec.hi]


def new_row(layout: RegionLayout) -> Tensor:
    return host_zeros(layout.row, torch.float32)
