"""Why graph regions stream together, in words: the planner joins regions whose spans
overlap in a graph into one unit (problem._units), which a budget must hold at once; each
join is recorded as a `Merge`, and `joined_streaming` turns a step's merges into the
sentence the backend's warning and refusals carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .problem import StepProblem


@dataclass(frozen=True)
class Merge:
    """Why two graph regions stream as one unit: in `graph` ("forward" or "backward"),
    region `first` reaches node `reach` (computed for it, or reading a weight fetched for
    it when `through_weight`), past node `start`, where region `second` begins."""

    graph: str
    first: int
    second: int
    reach: str
    start: str
    through_weight: bool
    param: int | None = None  # the weight's parameter index, when through_weight

    def describe(self, names: dict[int, str], param_names: list[str] = ()) -> str:
        what = "a weight"
        if self.param is not None and self.param < len(param_names):
            what = f"weight {param_names[self.param]!r}"
        how = f"reads {what} fetched for it at" if self.through_weight else "computes at"
        return (f"in the {self.graph} graph, {names.get(self.first, self.first)!r} {how} node "
                f"{self.reach!r}, after {names.get(self.second, self.second)!r} starts (node {self.start!r})")


def joined_streaming(sp: "StepProblem", names: dict[int, str], param_names: list[str] = ()) -> str:
    """A sentence for each planner unit that streams the weights of several graph regions
    together (their spans overlap in a graph, so they cannot be fetched apart), saying
    which tensor or weight is live across which regions; "" when every region that has
    weights streams on its own."""
    out = []
    for members in sp.units.values():
        if sum(1 for m in members if m in sp.weighted) < 2:
            continue
        # The first overlap is the cause; the later ones follow from the span it made.
        why = [m.describe(names, param_names) for m in sp.merges if m.first in members or m.second in members]
        out.append(f"regions {', '.join(repr(names.get(m, m)) for m in members)} stream their weights "
                   f"together, as one region (a budget must hold all of them at once), because {why[0]}"
                   + (f" (the {len(why) - 1} further overlaps follow from it)" if len(why) > 1 else ""))
    return ". ".join(out)
