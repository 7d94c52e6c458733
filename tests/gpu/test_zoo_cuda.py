"""The Hugging Face zoo on CUDA in bf16 (issue 7): every model trains 10 steps through
`backend="megatrain"` (fp32 master on the host, bf16 compute on the GPU, budget under half
the parameter bytes) and its losses stay within 2% of eager bf16 autocast training of a
copy on the same GPU. The worst relative loss gap per model goes to backend_gpu.jsonl."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain

from ..compiler.helpers import compile_streamed, param_bytes
from ..compiler.test_hf_zoo import BUDGET, ZOO
from .results import record_result

pytestmark = pytest.mark.gpu

STEPS = 10


def _to(kw: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# Known failures, kept visible (strict: a fix makes them fail as XPASS until moved here).
_KNOWN = {
    # dynamo traces the fp32 model, so `torch.finfo(scores.dtype).min` is fp32's; under
    # bf16 autocast the mask fill overflows bf16 when AOTAutograd traces it on CUDA
    "deberta_v2": "fp32 finfo.min mask fill overflows bf16 under autocast on CUDA",
    # its CUDA graph's leanest plan needs ~2-4% more than 0.49x its weights (also at the
    # commit before the regions changes)
    "phi3": "the CUDA plan's least budget is a few percent over 0.49x the weights",
    # bf16 rounding drifts past 2% of eager autocast within 10 steps (exact in fp32 on CPU)
    "clip": "bf16 loss drifts past 2% of eager autocast within 10 steps",
    "switch": "bf16 loss drifts past 2% of eager autocast within 10 steps",
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN[n]))
                                  if n in _KNOWN else n for n in sorted(ZOO)])
def test_zoo_bf16_on_cuda_tracks_eager_autocast(name):
    build, inputs, _ = ZOO[name]
    torch.manual_seed(0)
    model = build()
    model.train()
    ref = copy.deepcopy(model).cuda()
    budget = int(BUDGET.get(name, 0.49) * param_bytes(model))
    step = compile_streamed(model, {"device": "cuda", "precision": "bf16", "gpu_memory": budget})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = megatrain.AdamW(model.parameters(), lr=1e-3)
    worst, losses = 0.0, []
    for _ in range(STEPS):
        kw = inputs()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_ref = ref(**_to(kw, "cuda")).loss
        loss_ref.backward()
        loss = step(**kw).loss
        loss.backward()
        losses.append((loss.item(), loss_ref.item()))
        worst = max(worst, abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    plan = megatrain.explain(step)
    record_result(f"zoo_bf16_{name}", {"worst_rel_loss_gap": worst, "losses": losses,
                                 "budget": budget, "peak": plan.measured_peak_bytes})
    assert worst < 0.02, losses
    assert plan.measured_peak_bytes <= budget
