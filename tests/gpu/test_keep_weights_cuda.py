"""Option keep_weights on CUDA: the backward of the regions whose forward weights the plan
keeps reads the forward's device buffer instead of a second fetch; the results must match
fetching twice, and the step must stay within gpu_memory with the kept buffers counted.

Tolerance as in test_grad_ring_cuda.py: CUDA reductions with atomics differ run to run by
~1e-7 relative, which AdamW amplifies where |g| ~ eps: rtol=atol=1e-5. A stale or wrong
buffer (another region's weights, or last step's) moves parameters by ~lr = 3e-3.
"""

from __future__ import annotations

import pytest

from .compare import assert_runs_agree, seeded_llama_and_batches, train_fp32_on_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]


def test_kept_weights_match_fetching_twice_on_cuda():
    model, batches = seeded_llama_and_batches()
    kept, kept_losses, plan = train_fp32_on_cuda(model, batches, keep_weights=True, updates="host")
    twice, twice_losses, _ = train_fp32_on_cuda(model, batches, keep_weights=False, updates="host")
    assert len(plan.schedule.plan.config.kept_weights) >= 4, plan.schedule.plan.config
    assert plan.measured_peak_bytes <= plan.budget
    assert_runs_agree(model, kept, twice, kept_losses, twice_losses)
