"""The gradient ring on CUDA (option grad_chunk, megatrain.runtime.grad_ring): each gradient
is snapshotted on the compute stream and copied piece by piece into small page-locked
chunks on the D2H stream; a full chunk goes to megatrain.AdamW from the hand-off thread.
Checked against region slabs.

Tolerance as in test_backlog_cuda.py: CUDA reductions with atomics differ run to run by
~1e-7 relative, which AdamW amplifies where |g| ~ eps: rtol=atol=1e-5. A piece handed over
before its copy finished, lost or applied twice moves parameters by ~lr = 3e-3.
"""

from __future__ import annotations

import pytest

from .compare import assert_runs_agree, seeded_llama_and_batches, train_fp32_on_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]


def test_ring_matches_region_slabs_on_cuda():
    model, batches = seeded_llama_and_batches()
    # 192 KiB chunks: the 512 x 256 embedding (512 KiB) and each MLP weight are cut
    ring, ring_losses, plan = train_fp32_on_cuda(model, batches, grad_chunk=192 << 10, updates="host")
    slabs, slab_losses, _ = train_fp32_on_cuda(model, batches, grad_chunk=None, updates="host")
    s = plan.streamer
    assert s._ring.allocated <= 4 and s._slabs.allocated == 0, "every gradient took the ring"
    assert plan.measured_peak_bytes <= plan.budget
    assert_runs_agree(model, ring, slabs, ring_losses, slab_losses)
