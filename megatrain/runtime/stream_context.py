"""What the parts of one `Streamer` share: the device, its two copy streams, the device
pool that enforces ``gpu_memory``, and the step's stats.

Why one object instead of each part keeping its own references: the stats are replaced at
every ``begin_step`` (the finished ones stay readable as ``Streamer.last_stats``), so a part
that kept the object it was built with would count into a step long gone. Parts read
``ctx.stats`` at each use; everything else here is fixed for the streamer's life.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.pool import DevicePool
from .step_stats import StepStats


@dataclass
class StreamContext:
    device: torch.device
    pool: DevicePool
    stats: StepStats
    # Beside the compute stream, ordered with events only (no `record_stream`: it
    # fragments the caching allocator); None off CUDA.
    h2d_stream: torch.cuda.Stream | None = None
    d2h_stream: torch.cuda.Stream | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
