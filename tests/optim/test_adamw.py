"""megatrain.AdamW against torch: the p.grad path, the runtime's submit() path, accumulation,
clipping, the non-finite skip, state_dicts and the input checks. All on the CPU in fp32.

Equality is bitwise against torch.optim.AdamW(fused=True) (the same kernel) and to float
tolerance against the default torch.optim.AdamW (another rounding order).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import threading

import pytest
import torch

import megatrain.optim as mo

# ---- a small random problem ----------------------------------------------------------


def make_problem(seed: int) -> dict[str, torch.nn.Parameter]:
    """A 3-layer MLP with a gain vector and a 3-D mixing tensor; random sizes and values."""
    g = torch.Generator().manual_seed(1000 + seed)
    d_in, h, d_out = (int(torch.randint(3, 17, (), generator=g)) for _ in range(3))
    shapes = {
        "w1": (h, d_in),
        "b1": (h,),
        "w2": (h, h),
        "b2": (h,),
        "gain": (h,),
        "w3": (d_out, h),
        "mix": (2, 3, d_out),
    }
    return {
        k: torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for k, s in shapes.items()
    }


def clone_problem(P):
    return {k: torch.nn.Parameter(p.detach().clone()) for k, p in P.items()}


def loss_fn(P, x, y):
    h = torch.tanh(x @ P["w1"].T + P["b1"])
    h = torch.tanh(h @ P["w2"].T + P["b2"]) * P["gain"]
    out = h @ P["w3"].T
    out = out + P["mix"].sum(dim=(0, 1)) * torch.sin(out)
    return ((out - y) ** 2).mean()


def batch(P, seed: int, step: int, micro: int):
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + micro)
    d_in, d_out = P["w1"].shape[1], P["w3"].shape[0]
    return torch.randn(9, d_in, generator=g), torch.randn(9, d_out, generator=g)


GROUPS = [
    (["w1", "w2", "w3"], dict(lr=1e-2, weight_decay=0.1)),
    (["b1", "b2", "gain"], dict(lr=3e-2, weight_decay=0.0)),
    (["mix"], dict(lr=5e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-6)),
]
# Regions as the runtime would hand them in backward: layers in reverse, one region
# spanning two param groups.
REGIONS = [["mix", "w3"], ["w2", "b2", "gain"], ["w1", "b1"]]


def groups(P):
    return [{"params": [P[n] for n in names], **opts} for names, opts in GROUPS]


def in_group_order(P):
    return [P[n] for names, _ in GROUPS for n in names]


def warmup_cosine(total: int, warmup: int = 2):
    def f(t):
        if t < warmup:
            return (t + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (t - warmup) / max(1, total - warmup)))

    return f


# ---- drivers -------------------------------------------------------------------------


class Staging:
    """Two reusable grad slabs like the runtime's: a slab is clobbered with NaN as soon as
    the future of the region that used it resolves, so an optimizer that read a gradient
    after resolving would see NaN."""

    def __init__(self, numel: int):
        self.slabs = [torch.empty(numel), torch.empty(numel)]
        self.futures = [None, None]
        self.turn = 0

    def submit(self, opt, params, grads):
        s = self.turn
        self.turn ^= 1
        self.release(s)
        views, off = [], 0
        for g in grads:
            views.append(self.slabs[s][off : off + g.numel()].view(g.shape).copy_(g))
            off += g.numel()
        self.futures[s] = opt.submit(params, views)

    def release(self, s):
        if self.futures[s] is not None:
            self.futures[s].result()
            self.slabs[s].fill_(float("nan"))
            self.futures[s] = None

    def drain(self):
        self.release(0)
        self.release(1)


def submit_backward(opt, P, loss, staging, regions=REGIONS):
    names = [n for r in regions for n in r]
    grads = dict(zip(names, torch.autograd.grad(loss, [P[n] for n in names])))
    for r in regions:
        staging.submit(opt, [P[n] for n in r], [grads[n] for n in r])
    staging.drain()


def train(P, opt, *, seed, steps, micro=1, path="grad", clip=None, sched=None, drop=None):
    """Run ``steps`` optimizer steps of ``micro`` micro-batches each. ``path``: "grad"
    (autograd into p.grad) or "submit" (region by region through opt.submit). ``clip``
    clips outside the optimizer (the eager reference); ``drop`` = (step, micro) to leave
    out, for the negative controls."""
    staging = Staging(sum(p.numel() for p in P.values()))
    for t in range(steps):
        for k in range(micro):
            if drop == (t, k):
                continue
            x, y = batch(P, seed, t, k)
            loss = loss_fn(P, x, y) / micro
            if path == "grad":
                loss.backward()
            else:
                ctx = opt.accumulate() if k < micro - 1 else contextlib.nullcontext()
                with ctx:
                    submit_backward(opt, P, loss, staging)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(in_group_order(P), clip, foreach=False)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def assert_same(P, Q, opt_p=None, opt_q=None):
    for k in P:
        assert torch.equal(P[k], Q[k]), f"param {k} differs: {(P[k] - Q[k]).abs().max()}"
        if opt_p is not None:
            sp, sq = opt_p.state[P[k]], opt_q.state[Q[k]]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(sp[key], sq[key]), f"state {key} of {k} differs"


def differs(P, Q):
    return any(not torch.equal(P[k], Q[k]) for k in P)


# ---- exactness -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_bitwise_equal_to_torch_fused_with_groups_and_schedule(seed):
    P = make_problem(seed)
    Q = clone_problem(P)
    steps = 7
    ours = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    s_ours = torch.optim.lr_scheduler.LambdaLR(ours, warmup_cosine(steps))
    s_ref = torch.optim.lr_scheduler.LambdaLR(ref, warmup_cosine(steps))
    train(P, ours, seed=seed, steps=steps, sched=s_ours)
    train(Q, ref, seed=seed, steps=steps, sched=s_ref)
    assert_same(P, Q, ours, ref)
    assert differs(P, make_problem(seed))  # it trained
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]


def test_close_to_default_torch_adamw():
    """Same gradients into both (so rounding cannot feed back through the loss): the only
    difference is the kernel's rounding order, a few ulp after many steps."""
    P = make_problem(2)
    Q = clone_problem(P)
    steps = 10
    ours, ref = mo.AdamW(groups(P)), torch.optim.AdamW(groups(Q))  # ref: single-tensor math
    s_ours = torch.optim.lr_scheduler.LambdaLR(ours, warmup_cosine(steps))
    s_ref = torch.optim.lr_scheduler.LambdaLR(ref, warmup_cosine(steps))
    for t in range(steps):
        grads = random_grads(P, 50 + t)
        for k in P:
            P[k].grad, Q[k].grad = grads[k].clone(), grads[k].clone()
        for o, s in ((ours, s_ours), (ref, s_ref)):
            o.step()
            o.zero_grad()
            s.step()
    for k in P:
        torch.testing.assert_close(P[k], Q[k], rtol=1e-6, atol=1e-9)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                ours.state[P[k]][key], ref.state[Q[k]][key], rtol=1e-6, atol=1e-12
            )


@pytest.mark.parametrize("seed", [3, 4])
def test_submit_path_equals_p_grad_path(seed):
    P = make_problem(seed)
    Q, R = clone_problem(P), clone_problem(P)
    steps = 5
    sub, grad = mo.AdamW(groups(P)), mo.AdamW(groups(Q))
    ref = torch.optim.AdamW(groups(R), fused=True)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(steps)) for o in (sub, grad, ref)]
    train(P, sub, seed=seed, steps=steps, path="submit", sched=scheds[0])
    train(Q, grad, seed=seed, steps=steps, sched=scheds[1])
    train(R, ref, seed=seed, steps=steps, sched=scheds[2])
    assert_same(P, Q, sub, grad)
    assert_same(P, R, sub, ref)
    assert all(p.grad is None for p in P.values())  # the plain path keeps no grad buffer
    assert not sub._grad_buffers


def test_submit_updates_region_now_and_wait_params():
    P = make_problem(5)
    Q = clone_problem(P)
    opt = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    x, y = batch(P, 5, 0, 0)
    names = list(P)
    grads = torch.autograd.grad(loss_fn(P, x, y), [P[n] for n in names])
    loss_fn(Q, x, y).backward()
    ref.step()
    region = ["w3", "mix"]
    before = {n: P[n].detach().clone() for n in names}
    opt.submit([P[n] for n in region], [grads[names.index(n)] for n in region])
    opt.wait_params([P["w3"]])
    opt.wait_params([P["mix"]])
    for n in names:  # updated before step(): only the submitted region
        assert torch.equal(P[n], Q[n] if n in region else before[n]), n
    opt.step()
    assert torch.equal(P["w1"], before["w1"])  # no gradient, no update (like torch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [64, 320, 1 << 22])
def test_low_precision_grads_equal_their_fp32_upcast(monkeypatch, dtype, chunk):
    """The runtime hands in 16-bit gradients; the update upcasts them chunk by chunk into a
    reused scratch. Chunks that split parameters (64), pack several (320) or hold all must
    give the bits of submitting grad.float(), over several steps."""
    from megatrain.optim import functional

    monkeypatch.setattr(functional, "UPCAST_CHUNK", chunk)
    P, Q = make_problem(5), clone_problem(make_problem(5))
    opt_p, opt_q = mo.AdamW(groups(P), lr=0.1), mo.AdamW(groups(Q), lr=0.1)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(3):
        low = {k: torch.randn(p.shape, generator=g).to(dtype) for k, p in P.items()}
        names = list(P)
        mixed = [low[k] if i % 3 else low[k].float() for i, k in enumerate(names)]  # both kinds
        opt_p.submit([P[k] for k in names], mixed).result()
        opt_q.submit([Q[k] for k in names], [low[k].float() for k in names]).result()
        opt_p.step(), opt_q.step()
        opt_p.zero_grad(), opt_q.zero_grad()
    assert_same(P, Q, opt_p, opt_q)
    assert differs(P, make_problem(5))


def test_layout_mismatch_between_grad_and_param():
    """A transposed (non-contiguous) parameter fed contiguous staging grads: the CPU fused
    kernel walks raw memory, so the optimizer must re-lay the grad; compare with the
    default (stride-aware) torch AdamW."""
    g = torch.Generator().manual_seed(6)
    p = torch.nn.Parameter(torch.randn(8, 6, generator=g).t())
    q = torch.nn.Parameter(p.detach().clone())  # clone keeps the transposed strides
    assert not p.is_contiguous() and q.stride() == p.stride()
    opt, ref = mo.AdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1)
    for _ in range(3):
        grad = torch.randn(6, 8, generator=g)  # contiguous
        opt.submit([p], [grad]).result()
        q.grad = grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ---- state_dict ------------------------------------------------------------------------


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("source", ["megatrain", "torch"])
def test_state_dict_round_trip(source):
    P = make_problem(7)
    Q = clone_problem(P)
    first = (
        mo.AdamW(groups(P))
        if source == "megatrain"
        else torch.optim.AdamW(groups(P), fused=True)
    )
    ref = torch.optim.AdamW(groups(Q), fused=True)
    train(P, first, seed=7, steps=3)
    train(Q, ref, seed=7, steps=3)
    sd = roundtrip(first.state_dict())
    P2 = clone_problem(P)  # "restart": fresh params from the checkpoint, fresh optimizer
    resumed = mo.AdamW(groups(P2), lr=0.5, weight_decay=0.0)  # wrong values, overwritten
    resumed.load_state_dict(sd)
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in ref.param_groups]
    train(P2, resumed, seed=8, steps=3)
    train(Q, ref, seed=8, steps=3)
    assert_same(P2, Q, resumed, ref)
    # and back: megatrain's state_dict loads into torch.optim.AdamW
    R = clone_problem(P2)
    back = torch.optim.AdamW(groups(R), fused=True)
    back.load_state_dict(roundtrip(resumed.state_dict()))
    train(R, back, seed=9, steps=2)
    train(P2, resumed, seed=9, steps=2)
    assert_same(P2, R, resumed, back)


def test_load_rejects_amsgrad_state():
    P = make_problem(8)
    src = torch.optim.AdamW(groups(P), amsgrad=True)
    train(P, src, seed=8, steps=1)
    opt = mo.AdamW(groups(clone_problem(P)))
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(roundtrip(src.state_dict()))


# ---- gradient accumulation ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["grad", "submit"])
def test_accumulation_matches_eager(path):
    micro, steps, seed = 4, 3, 9
    P = make_problem(seed)
    Q, D = clone_problem(P), clone_problem(P)
    ours = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    train(P, ours, seed=seed, steps=steps, micro=micro, path=path)
    train(Q, ref, seed=seed, steps=steps, micro=micro)
    assert_same(P, Q, ours, ref)
    # Negative control: the comparison sees a single dropped micro-batch.
    dropped = torch.optim.AdamW(groups(D), fused=True)
    train(D, dropped, seed=seed, steps=steps, micro=micro, drop=(1, micro - 1))
    assert differs(D, Q)


@pytest.mark.parametrize("k", [0, 2, 3])
def test_accumulation_every_micro_batch_counts_through_submit(k):
    micro, seed = 4, 10
    P = make_problem(seed)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    train(P, ours, seed=seed, steps=2, micro=micro, path="submit", drop=(1, k))
    train(Q, ref, seed=seed, steps=2, micro=micro)
    assert differs(P, Q)


def test_accumulation_all_inside_context_is_applied_by_step():
    micro, seed = 3, 11
    P = make_problem(seed)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P))
    ref = torch.optim.AdamW(groups(Q), fused=True)
    staging = Staging(sum(p.numel() for p in P.values()))
    for k in range(micro):
        x, y = batch(P, seed, 0, k)
        with ours.accumulate():
            submit_backward(ours, P, loss_fn(P, x, y) / micro, staging)
        (loss_fn(Q, x, y) / micro).backward()
    before = {n: p.detach().clone() for n, p in P.items()}
    assert_same(P, before)  # nothing applied while accumulating
    ours.step()
    ref.step()
    assert_same(P, Q, ours, ref)
    # the buffers are recycled: a second step allocates nothing new
    buffers = dict(ours._grad_buffers)
    ours.zero_grad()
    ref.zero_grad()
    train(P, ours, seed=seed, steps=1, micro=micro, path="submit")
    train(Q, ref, seed=seed, steps=1, micro=micro)
    assert_same(P, Q, ours, ref)
    assert all(ours._grad_buffers[p] is b for p, b in buffers.items())
    ours.release_grad_buffers()
    ours.zero_grad()
    assert not ours._grad_buffers and all(p.grad is None for p in P.values())


def test_deepcopy_keeps_options_and_state():
    P = make_problem(19)
    opt = mo.AdamW(groups(P), max_grad_norm=0.1, skip_nonfinite=True, threads=1)
    train(P, opt, seed=19, steps=2, path="submit")
    twin = copy.deepcopy(opt)
    assert (twin.max_grad_norm, twin.skip_nonfinite, twin.threads) == (0.1, True, 1)
    assert twin._worker is not opt._worker
    Q = {k: twin.param_groups[gi]["params"][i] for gi, (names, _) in enumerate(GROUPS)
         for i, k in enumerate(names)}
    assert_same(P, Q, opt, twin)
    train(P, opt, seed=20, steps=2, path="submit")
    train(Q, twin, seed=20, steps=2, path="submit")
    assert_same(P, Q, opt, twin)


def test_second_final_submit_in_one_step_is_an_error():
    P = make_problem(12)
    opt = mo.AdamW(groups(P))
    g = torch.randn(P["w1"].shape)
    opt.submit([P["w1"]], [g])
    with pytest.raises(ValueError, match=r"accumulate\(\)"):
        opt.submit([P["w1"]], [g])
    with pytest.raises(ValueError, match="already received"):
        with opt.accumulate():
            opt.submit([P["w1"]], [g])
    opt.step()
    opt.submit([P["w1"]], [g]).result()  # a new step accepts it again


# ---- clipping ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["grad", "submit"])
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clipping_matches_clip_grad_norm(path, max_norm):
    seed, micro = 13, 2
    P = make_problem(seed)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P), max_grad_norm=max_norm)
    ref = torch.optim.AdamW(groups(Q), fused=True)
    norms = []
    for t in range(4):
        train(P, ours, seed=seed + t, steps=1, micro=micro, path=path)
        norms.append(ours.last_grad_norm)
        for k in range(micro):
            x, y = batch(Q, seed + t, 0, k)
            (loss_fn(Q, x, y) / micro).backward()
        total = torch.nn.utils.clip_grad_norm_(in_group_order(Q), max_norm, foreach=False)
        ref.step()
        ref.zero_grad()
        assert torch.equal(norms[-1], total)
    assert_same(P, Q, ours, ref)
    if max_norm < 1:
        assert all(n > max_norm for n in norms)  # clipping was active every step


def test_clipping_negative_control():
    P = make_problem(14)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P), max_grad_norm=0.05)
    unclipped = torch.optim.AdamW(groups(Q), fused=True)
    train(P, ours, seed=14, steps=2)
    train(Q, unclipped, seed=14, steps=2)
    assert differs(P, Q)


# ---- non-finite gradients -----------------------------------------------------------------


def random_grads(P, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) for k, p in P.items()}


def apply(opt, P, grads, path):
    if path == "grad":
        for k, p in P.items():
            p.grad = grads[k].clone()
    else:
        staging = Staging(sum(p.numel() for p in P.values()))
        for r in REGIONS:
            staging.submit(opt, [P[n] for n in r], [grads[n] for n in r])
        staging.drain()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("path", ["grad", "submit"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_nonfinite_step_is_skipped(path, clip):
    P = make_problem(15)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P), skip_nonfinite=True, max_grad_norm=clip)
    ref = torch.optim.AdamW(groups(Q), fused=True)

    def ref_step(grads):
        for k, q in Q.items():
            q.grad = grads[k].clone()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(in_group_order(Q), clip, foreach=False)
        ref.step()
        ref.zero_grad()

    g1 = random_grads(P, 1)
    apply(ours, P, g1, path)
    ref_step(g1)
    snapshot = {k: p.detach().clone() for k, p in P.items()}
    state = {k: {s: v.clone() for s, v in ours.state[p].items()} for k, p in P.items()}

    bad = random_grads(P, 2)
    bad["w2"][1, 2] = float("nan")
    bad["b1"][0] = float("inf")
    first_bad = r"non-finite gradient in param_groups\[0\]\['params'\]\[1\]"  # w2
    with pytest.warns(RuntimeWarning, match=first_bad):
        apply(ours, P, bad, path)
    assert ours.skipped_steps == 1
    for k, p in P.items():
        assert torch.equal(p, snapshot[k]), k
        for s, v in state[k].items():
            assert torch.equal(ours.state[p][s], v), (k, s)

    g3 = random_grads(P, 3)
    apply(ours, P, g3, path)
    ref_step(g3)
    assert_same(P, Q, ours, ref)
    assert ours.skipped_steps == 1


def test_nonfinite_without_skip_behaves_like_torch():
    P = make_problem(16)
    Q = clone_problem(P)
    ours, ref = mo.AdamW(groups(P)), torch.optim.AdamW(groups(Q), fused=True)
    bad = random_grads(P, 4)
    bad["w3"][0, 0] = float("nan")
    apply(ours, P, bad, "submit")
    for k, q in Q.items():
        q.grad = bad[k].clone()
    ref.step()
    for k in P:
        assert torch.equal(P[k].isnan(), Q[k].isnan())
        assert torch.equal(P[k].nan_to_num(), Q[k].nan_to_num())


def test_overflowing_norm_of_finite_grads_is_not_skipped():
    p = torch.nn.Parameter(torch.ones(4))
    q = torch.nn.Parameter(torch.ones(4))
    ours = mo.AdamW([p], skip_nonfinite=True)
    ref = torch.optim.AdamW([q], fused=True)
    p.grad = torch.full((4,), 3e38)  # finite, but its 2-norm overflows fp32
    q.grad = p.grad.clone()
    with warnings_as_errors():
        ours.step()
    ref.step()
    assert torch.equal(p, q) and ours.skipped_steps == 0


@contextlib.contextmanager
def warnings_as_errors():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---- input checks ---------------------------------------------------------------------------


def test_bad_params_are_named():
    good = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\].*model\.float\(\)"):
        mo.AdamW([good, torch.nn.Parameter(torch.randn(2, dtype=torch.bfloat16))])
    with pytest.raises(TypeError, match="float64.*model.float"):
        mo.AdamW([torch.nn.Parameter(torch.randn(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="complex64.*view_as_real"):
        mo.AdamW([torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="'b'.*listed twice"):
        mo.AdamW([("a", good), ("b", good)])
    with pytest.raises(ValueError, match="listed twice"):
        mo.AdamW([{"params": [good]}, {"params": [good], "lr": 0.1}])
    with pytest.raises(ValueError, match="lr"):
        mo.AdamW([good], lr=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        mo.AdamW([good], max_grad_norm=0.0)
    opt = mo.AdamW([("a", good)])
    with pytest.raises(TypeError, match=r"parameter 'c'.*bfloat16"):
        opt.add_param_group({"params": [("c", torch.nn.Parameter(torch.randn(2).bfloat16()))]})
    assert len(opt.param_groups) == 1  # the bad group was not kept


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = mo.AdamW(emb.named_parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(TypeError, match=r"'weight'.*sparse.*sparse=False"):
        opt.step()
    with pytest.raises(TypeError, match="sparse"):
        opt.submit([emb.weight], [emb.weight.grad])


def test_bad_submit_input():
    P = make_problem(17)
    opt = mo.AdamW(list(P.items()))
    w = P["w1"]
    with pytest.raises(ValueError, match="one gradient per parameter"):
        opt.submit([w], [])
    with pytest.raises(TypeError, match=r"'w1'.*float64.*fp32"):
        opt.submit([w], [torch.zeros(w.shape, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"'w1'.*shape"):
        opt.submit([w], [torch.zeros(w.numel() + 1)])
    with pytest.raises(ValueError, match="not managed"):
        opt.submit([torch.nn.Parameter(torch.zeros(2))], [torch.zeros(2)])
    with pytest.raises(ValueError, match="twice"):
        opt.submit([w, w], [torch.zeros(w.shape), torch.zeros(w.shape)])
    assert all(p.grad is None for p in P.values())  # nothing was queued
    assert all(not s for s in opt.state.values())


# ---- threads --------------------------------------------------------------------------------


def test_thread_setting_stays_in_the_worker():
    before = torch.get_num_threads()
    P = make_problem(18)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P), threads=1 if before > 1 else 2)
    ref = torch.optim.AdamW(groups(Q), fused=True)
    assert torch.get_num_threads() == before
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [before]  # new threads still start from the process default
    train(P, ours, seed=18, steps=2, path="submit")
    train(Q, ref, seed=18, steps=2)
    assert_same(P, Q, ours, ref)


def test_set_threads_between_steps_keeps_results_exact():
    """Changing the worker's thread count mid-training (the bench's thread sweep) changes
    how the work is split, not the math: still bitwise torch's fused AdamW."""
    P = make_problem(19)
    Q = clone_problem(P)
    ours = mo.AdamW(groups(P), threads=1)
    ref = torch.optim.AdamW(groups(Q), fused=True)
    train(P, ours, seed=19, steps=1, path="submit")
    train(Q, ref, seed=19, steps=1)
    ours.set_threads(2)
    assert ours.threads == 2 and ours.state_dict()["state"]
    train(P, ours, seed=20, steps=2, path="submit")
    train(Q, ref, seed=20, steps=2)
    assert_same(P, Q, ours, ref)
    with pytest.raises(ValueError, match="threads"):
        ours.set_threads(0)


def test_prefer_threads_applies_only_when_threads_were_left_unset():
    chosen = mo.AdamW(groups(make_problem(21)), threads=1)
    chosen.prefer_threads(2)
    assert chosen.threads == 1
    unset = mo.AdamW(groups(make_problem(22)))
    unset.prefer_threads(1)
    assert unset.threads == 1
    unset.prefer_threads(2)  # still the user's default, so a later suggestion applies too
    assert unset.threads == 2


# ---- clipped updates overlap the next forward ------------------------------------------------


@pytest.mark.parametrize("option", [dict(max_grad_norm=0.05), dict(skip_nonfinite=True)])
def test_streamed_params_update_after_step_returns_in_fetch_order(option):
    """For parameters the backend streams (homed), step() with clipping or the finiteness
    check queues the updates region by region, last-submitted first (the next forward's
    fetch order), and returns before they run; the results equal the eager reference."""
    from megatrain.memory.host_store import home_parameters

    seed = 23
    P = make_problem(seed)
    Q = clone_problem(P)
    home_parameters(list(P.values()), pin=False)
    ours = mo.AdamW(groups(P), **option)
    ref = torch.optim.AdamW(groups(Q), fused=True)
    gate, order = threading.Event(), []
    update = ours._update

    def gated(ps, gs, *args):
        gate.wait(timeout=30)
        order.append({n for n, p in P.items() for q in ps if p is q})
        update(ps, gs, *args)

    ours._update = gated
    staging = Staging(sum(p.numel() for p in P.values()))
    for t in range(3):
        gate.clear()
        x, y = batch(P, seed, t, 0)
        submit_backward(ours, P, loss_fn(P, x, y), staging)
        before = {k: p.detach().clone() for k, p in P.items()}
        ours.step()  # returns while every update waits at the gate
        assert all(torch.equal(before[k], p) for k, p in P.items())
        ours.zero_grad()  # does not wait for the queued updates either
        gate.set()
        ours.wait_params([P[n] for n in REGIONS[-1]])
        ours.synchronize()
        x, y = batch(Q, seed, t, 0)
        loss_fn(Q, x, y).backward()
        if "max_grad_norm" in option:
            torch.nn.utils.clip_grad_norm_(in_group_order(Q), option["max_grad_norm"], foreach=False)
        ref.step()
        ref.zero_grad()
        assert_same(P, Q, ours, ref)
    # One step's tasks cover every parameter, region by region backwards (a region may
    # split into one task per param group).
    first_step = order[: len(order) // 3]
    assert set().union(*first_step) == set(P)
    region_of = {n: i for i, r in enumerate(REGIONS) for n in r}
    seq = [{region_of[n] for n in task} for task in first_step]
    assert all(len(r) == 1 for r in seq)
    seq = [r.pop() for r in seq]
    assert seq == sorted(seq, reverse=True) and len(set(seq)) == len(REGIONS)
