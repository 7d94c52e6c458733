"""The plan of a compiled graph: what `megatrain.explain` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from .regions import Region


@dataclass
class GraphPlan:
    """One dynamo graph (one backend call): its regions, schedules and lowered code."""

    regions: list[Region]
    slots: int
    budget: int
    forward_code: str = ""
    backward_code: str = ""
    forward_events: list[str] = field(default_factory=list)
    backward_events: list[str] = field(default_factory=list)
    prefetch_count: int = 0
    saved_activation_bytes: int = 0
    saved_activations: list[str] = field(default_factory=list)
    predicted_peak_bytes: int = 0
    streamer: object = None

    @property
    def code(self) -> str:
        return f"# forward\n{self.forward_code}\n# backward\n{self.backward_code}"

    @property
    def measured_peak_bytes(self) -> int | None:
        """Device bytes megatrain held at most during the last step (CUDA: allocator peak)."""
        s = self.streamer.last_stats if self.streamer is not None else None
        if s is None:
            return None
        if s.cuda_peak is not None:
            return s.cuda_peak
        return s.pool_peak


@dataclass
class Plan:
    graphs: list[GraphPlan]

    @property
    def regions(self) -> list[Region]:
        return [r for g in self.graphs for r in g.regions]

    @property
    def code(self) -> str:
        return "\n".join(g.code for g in self.graphs)

    @property
    def predicted_peak_bytes(self) -> int:
        return max((g.predicted_peak_bytes for g in self.graphs), default=0)

    @property
    def measured_peak_bytes(self) -> int | None:
        vals = [g.measured_peak_bytes for g in self.graphs if g.measured_peak_bytes is not None]
        return max(vals) if vals else None

    @property
    def prefetch_count(self) -> int:
        return sum(g.prefetch_count for g in self.graphs)
