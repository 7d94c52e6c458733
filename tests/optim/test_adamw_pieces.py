"""megatrain.AdamW.submit_pieces (the gradient ring's hand-off) against torch's fused AdamW.

Gradients are cut into pieces at random multiples of PIECE_ALIGN, in order, spread over
several calls that mix parameters, the way the runtime's fixed-size chunks cut them; each
piece's memory is clobbered with NaN once its call resolved, like a chunk going back to the
ring. Results must be bitwise those of torch.optim.AdamW(fused=True) fed whole gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import megatrain.optim as mo
from megatrain.optim.functional import PIECE_ALIGN

# Sizes around the kernel's vector width and the alignment: single elements, an odd tail,
# several pieces' worth.
SHAPES = {"emb": (97, 65), "w": (129, 31), "b": (3,), "v": (64,), "odd": (4099,)}


def problem(seed: int) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}


def clone(P):
    return {k: torch.nn.Parameter(p.detach().clone()) for k, p in P.items()}


def groups(P):
    return [{"params": [P["emb"], P["w"], P["odd"]], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [P["b"], P["v"]], "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def grads_for(P, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) * 0.1 for k, p in P.items()}


def cut(grads: dict[str, torch.Tensor], P, rng: torch.Generator, calls: int = 3):
    """The gradients as (param, start, piece) items, in backward-like order, each
    parameter cut at random aligned points, the items split into `calls` consecutive calls."""
    items = []
    for name in reversed(list(grads)):
        flat = grads[name].reshape(-1)
        start = 0
        while start < flat.numel():
            left = flat.numel() - start
            n = int(torch.randint(1, 4, (), generator=rng)) * PIECE_ALIGN
            n = left if n >= left or left <= PIECE_ALIGN else n
            items.append((P[name], start, flat[start:start + n].clone()))
            start += n
    bounds = sorted(int(b) for b in torch.randint(0, len(items) + 1, (calls - 1,), generator=rng))
    edges = [0, *bounds, len(items)]
    return [items[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def submit_all(opt, calls):
    for call in calls:
        opt.submit_pieces(call).result()
        for _, _, piece in call:
            piece.fill_(float("nan"))  # the chunk goes back to the ring


def assert_same(P, Q, opt_p, opt_q):
    for k in P:
        assert torch.equal(P[k], Q[k]), f"{k}: {(P[k] - Q[k]).abs().max()}"
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_p.state[P[k]][key], opt_q.state[Q[k]][key]), (k, key)


def run(opt_kwargs, micro=1, steps=3, seed=0, clip=None, poison=None):
    """(ours, torch) after `steps` steps of `micro` micro-batches, ours through pieces."""
    P = problem(seed)
    Q = clone(P)
    ours = mo.AdamW(groups(P), **opt_kwargs)
    ref = torch.optim.AdamW(groups(Q), fused=True)
    rng = torch.Generator().manual_seed(seed + 7)
    for t in range(steps):
        for k in range(micro):
            g = grads_for(P, 100 * seed + 10 * t + k)
            if poison == (t, k):
                g["w"][3, 4] = float("inf")
            with ours.accumulate() if k < micro - 1 else contextlib.nullcontext():
                submit_all(ours, cut(g, P, rng))
            for name, q in Q.items():
                q.grad = g[name].clone() if q.grad is None else q.grad.add_(g[name])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([q for grp in groups(Q) for q in grp["params"]], clip,
                                           foreach=False)
        ours.step()
        ours.zero_grad()
        if poison is None or poison[0] != t:
            ref.step()
        ref.zero_grad()
    ours.synchronize()
    return P, Q, ours, ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_equal_whole_gradients_bitwise(seed):
    assert_same(*run({}, seed=seed))


def test_pieces_accumulate_over_micro_batches():
    assert_same(*run({}, micro=3, seed=3))


def test_pieces_with_clipping():
    P, Q, ours, ref = run(dict(max_grad_norm=0.05), micro=2, seed=4, clip=0.05)
    assert_same(P, Q, ours, ref)
    assert ours.last_grad_norm > 0.05  # clipping was active


def test_pieces_with_a_non_finite_gradient_skip_the_step():
    with pytest.warns(RuntimeWarning, match="non-finite"):
        P, Q, ours, ref = run(dict(skip_nonfinite=True), seed=5, poison=(1, 0))
    assert ours.skipped_steps == 1
    assert_same(P, Q, ours, ref)


def test_a_missing_piece_is_seen():
    """Negative control: one dropped piece changes the result."""
    P = problem(6)
    Q = clone(P)
    ours = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    g = grads_for(P, 6)
    calls = cut(g, P, torch.Generator().manual_seed(1))
    flat = [item for call in calls for item in call]
    p, start, piece = flat[1]
    piece.zero_()  # its elements arrive as zeros: the optimizer cannot tell, the result can
    submit_all(ours, [flat])
    for name, q in Q.items():
        q.grad = g[name]
    ref.step()
    ours.synchronize()
    assert not all(torch.equal(P[k], Q[k]) for k in P)


def test_bad_pieces_are_refused_with_the_reason():
    P = problem(7)
    opt = mo.AdamW(groups(P))
    w = P["w"]
    with pytest.raises(ValueError, match="multiple of 64"):
        opt.submit_pieces([(w, 3, torch.zeros(64))])
    with pytest.raises(ValueError, match="does not fit"):
        opt.submit_pieces([(w, 3968, torch.zeros(128))])
    with pytest.raises(ValueError, match="in order"):
        opt.submit_pieces([(w, 64, torch.zeros(64))])
    with pytest.raises(TypeError, match="1-D"):
        opt.submit_pieces([(w, 0, torch.zeros(8, 8))])
    with pytest.raises(ValueError, match="not managed"):
        opt.submit_pieces([(torch.nn.Parameter(torch.zeros(64)), 0, torch.zeros(64))])
    opt.submit_pieces([(P["v"], 0, torch.zeros(64))]).result()
    with pytest.raises(ValueError, match="already received"):
        opt.submit_pieces([(P["v"], 0, torch.zeros(64))])
