"""The CPU twin's graph break inside every layer on CUDA, where the next graph's first
fetch really runs ahead on the copy stream (tests/compiler/test_foreign_weights.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain

from ..compiler.helpers import compile_streamed, flat, rel
from ..compiler.test_foreign_weights import _SplitStack

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.filterwarnings("ignore:megatrain. the model has a graph break")]


@pytest.mark.parametrize("fast_path", [False, True], ids=["torch AdamW", "megatrain.AdamW"])
def test_cuda_break_inside_each_layer_trains_each_layer_with_its_own_weights(fast_path):
    torch.manual_seed(0)
    model = _SplitStack()
    ref = copy.deepcopy(model).cuda()
    step = compile_streamed(model, {"device": "cuda", "precision": "fp32", "gpu_memory": 1 << 30})
    opt = (megatrain.AdamW if fast_path else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with megatrain.config.patch(check_fetched_weights=True):
        for i in range(3):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
            loss, loss_ref = step(x), ref(x.cuda())
            loss.backward()
            loss_ref.backward()
            assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), i
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
    if fast_path:
        opt.synchronize()
    assert rel(flat(model.parameters()), flat(p.cpu() for p in ref.parameters())) < 1e-4
