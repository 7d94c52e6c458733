"""Final bf16 gradients held for step() in bf16 (optim/narrow_grads.py) against the fp32 path.

With clipping or the non-finite check a final gradient waits for step(). One handed in as
bf16 for an fp32 parameter with nothing to sum it with is held in bf16; the same gradient
handed in upcast to fp32 takes the fp32 ``p.grad`` path. Both must give bitwise the same
parameters, moments, step counts and reported norms, through ``submit`` and through
``submit_pieces``, while the held one costs half the gradient bytes. Inputs are fresh
random values each run (the seed is in the failure message).
"""

from __future__ import annotations

import copy
import io
import secrets

import pytest
import torch

import megatrain.optim as mo
from megatrain.optim import functional
from megatrain.optim.functional import PIECE_ALIGN

BF16 = torch.bfloat16
# Sizes around the kernel's vector width and the piece alignment; "t" is transposed (not
# contiguous: submit only).
SHAPES = {"emb": (33, 65), "w": (129, 31), "b": (3,), "v": (64,), "odd": (4099,), "t": (7, 19)}
REGIONS = [["t", "odd"], ["w", "b", "v"], ["emb"]]
GROUP_NAMES = [["emb", "w", "odd", "t"], ["b", "v"]]


def problem(seed: int, contiguous: bool = False) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    P = {k: torch.nn.Parameter(torch.randn(s, generator=g)) for k, s in SHAPES.items()}
    if contiguous:
        del P["t"]
    else:
        P["t"] = torch.nn.Parameter(torch.randn(SHAPES["t"][::-1], generator=g).t())
    return P


def twin(P):
    return {k: torch.nn.Parameter(p.detach().clone()) for k, p in P.items()}


def groups(P):
    first, second = ([P[k] for k in names if k in P] for names in GROUP_NAMES)
    return [{"params": first, "lr": 1e-2, "weight_decay": 0.1},
            {"params": second, "lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def bf16_grads(P, g: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random bf16 gradients (wide enough in range that the global norm is far above the
    clip), contiguous whatever the parameter's layout, like a staging slab's views."""
    return {k: (torch.randn(p.shape, generator=g) * scale).to(BF16) for k, p in P.items()}


def hand_in(opt, P, grads, path, rng=None):
    """Submit ``grads`` region by region (or as aligned pieces over several calls), waiting
    for each call and then clobbering what was handed in, like a slab or ring chunk going
    back to the runtime."""
    calls = []
    if path == "submit":
        for r in REGIONS:
            names = [n for n in r if n in grads]
            views = [grads[n].clone() for n in names]
            calls.append((opt.submit([P[n] for n in names], views), views))
    else:
        items = []
        for name in reversed(list(grads)):
            flat, start = grads[name].reshape(-1), 0
            while start < flat.numel():
                n = int(torch.randint(1, 4, (), generator=rng)) * PIECE_ALIGN
                n = min(n, flat.numel() - start)
                items.append((P[name], start, flat[start:start + n].clone()))
                start += n
        cut = sorted(int(b) for b in torch.randint(1, len(items), (2,), generator=rng))
        for a, b in zip([0, *cut], [*cut, len(items)]):
            if b > a:
                chunk = items[a:b]
                calls.append((opt.submit_pieces(chunk), [piece for *_, piece in chunk]))
    for future, handed in calls:
        future.result()
        for t in handed:
            t.fill_(float("nan"))


def assert_same(P, Q, opt_p, opt_q, seed):
    for k in P:
        assert torch.equal(P[k], Q[k]), (seed, k, (P[k] - Q[k]).abs().max())
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_p.state[P[k]][key], opt_q.state[Q[k]][key]), (seed, k, key)


def upcast(grads):
    return {k: g.float() for k, g in grads.items()}


@pytest.fixture
def seed():
    return secrets.randbits(30)


# ---- clipping: submit and pieces --------------------------------------------------------


@pytest.mark.parametrize("chunk", [64, functional.UPCAST_CHUNK])
@pytest.mark.parametrize("path", ["submit", "pieces"])
def test_held_bf16_equals_fp32_path_with_clipping(monkeypatch, path, chunk, seed):
    """Over 3 steps: params, m, v, step counts and the reported norm bitwise those of the
    fp32 path (the same gradients upcast), clipping active every step; and both equal
    torch's clip_grad_norm_ + fused AdamW. ``chunk`` 64 cuts every parameter's upcast
    (and its clip multiply) into many pieces."""
    monkeypatch.setattr(functional, "UPCAST_CHUNK", chunk)
    max_norm = 0.5
    P = problem(seed, contiguous=path == "pieces")
    Q, R = twin(P), twin(P)
    held = mo.AdamW(groups(P), max_grad_norm=max_norm)
    fp32 = mo.AdamW(groups(Q), max_grad_norm=max_norm)
    ref = torch.optim.AdamW(groups(R), fused=True)
    g = torch.Generator().manual_seed(seed)
    rng_p, rng_q = (torch.Generator().manual_seed(seed + 1) for _ in range(2))
    for _ in range(3):
        grads = bf16_grads(P, g)
        hand_in(held, P, grads, path, rng_p)
        hand_in(fp32, Q, upcast(grads), path, rng_q)
        assert all(p.grad is None for p in P.values())  # held by the optimizer, not in p.grad
        assert all(q.grad is not None and q.grad.dtype == torch.float32 for q in Q.values())
        for k, r in R.items():
            r.grad = torch.empty_like(r).copy_(grads[k])  # laid out like r: fused walks memory
        total = torch.nn.utils.clip_grad_norm_([r for grp in groups(R) for r in grp["params"]],
                                               max_norm, foreach=False)
        held.step(), fp32.step(), ref.step()
        assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), seed
        assert torch.equal(held.last_grad_norm, total), seed
        assert held.last_grad_norm > max_norm  # clipping was active
        held.zero_grad(), fp32.zero_grad(), ref.zero_grad()
    held.synchronize(), fp32.synchronize()
    assert_same(P, Q, held, fp32, seed)
    assert_same(P, R, held, ref, seed)
    # the gradient bytes the optimizers keep: the held dtype's, against fp32's
    n = sum(p.numel() for p in P.values())
    assert held.grad_buffer_bytes() == n * BF16.itemsize
    assert fp32.grad_buffer_bytes() == n * torch.float32.itemsize
    assert held.grad_buffer_bytes() < fp32.grad_buffer_bytes()


def test_negative_control_a_changed_held_gradient_is_seen(seed):
    """The comparison above can fail: one bf16 ulp changed in one gradient changes the
    result."""
    P = problem(seed)
    Q = twin(P)
    held, fp32 = mo.AdamW(groups(P), max_grad_norm=0.5), mo.AdamW(groups(Q), max_grad_norm=0.5)
    grads = bf16_grads(P, torch.Generator().manual_seed(seed))
    other = upcast(grads)
    other["w"][5, 3] *= 1 + 2 ** -7  # one bf16 ulp up
    hand_in(held, P, grads, "submit")
    hand_in(fp32, Q, other, "submit")
    held.step(), fp32.step()
    assert not torch.equal(held.state[P["w"]]["exp_avg"], fp32.state[Q["w"]]["exp_avg"])


# ---- the non-finite skip ----------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("path", ["submit", "pieces"])
def test_held_bf16_inf_skips_the_step_like_fp32(path, clip, seed):
    P = problem(seed, contiguous=path == "pieces")
    Q = twin(P)
    held = mo.AdamW(groups(P), skip_nonfinite=True, max_grad_norm=clip)
    fp32 = mo.AdamW(groups(Q), skip_nonfinite=True, max_grad_norm=clip)
    g = torch.Generator().manual_seed(seed)
    rngs = [torch.Generator().manual_seed(seed + 1) for _ in range(2)]
    for t in range(3):
        grads = bf16_grads(P, g, scale=0.1)
        if t == 1:
            grads["odd"][int(torch.randint(4099, (), generator=g))] = float("inf")
            before = {k: p.detach().clone() for k, p in P.items()}
            moments = {k: {s: v.clone() for s, v in held.state[p].items()} for k, p in P.items()}
        hand_in(held, P, grads, path, rngs[0])
        hand_in(fp32, Q, upcast(grads), path, rngs[1])
        if t == 1:
            with pytest.warns(RuntimeWarning, match="non-finite"):
                held.step()
            with pytest.warns(RuntimeWarning, match="non-finite"):
                fp32.step()
            held.synchronize()
            for k, p in P.items():
                assert torch.equal(p, before[k]), (seed, k)
                assert all(torch.equal(held.state[p][s], v) for s, v in moments[k].items())
        else:
            held.step(), fp32.step()
        if clip is not None:
            assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), (seed, t)
        held.zero_grad(), fp32.zero_grad()
    assert held.skipped_steps == fp32.skipped_steps == 1
    held.synchronize(), fp32.synchronize()
    assert_same(P, Q, held, fp32, seed)


# ---- where the fp32 path stays ------------------------------------------------------------


@pytest.mark.parametrize("path", ["submit", "pieces"])
def test_accumulation_and_fp32_gradients_keep_the_fp32_buffer(path, seed):
    """Micro-batches under accumulate() are summed in fp32 p.grad, and fp32 gradients are
    never held: the bytes say which parameters got which buffer, and results stay exact."""
    P = problem(seed, contiguous=path == "pieces")
    Q = twin(P)
    held = mo.AdamW(groups(P), max_grad_norm=0.5)
    fp32 = mo.AdamW(groups(Q), max_grad_norm=0.5)
    g = torch.Generator().manual_seed(seed)
    rngs = [torch.Generator().manual_seed(seed + 1) for _ in range(2)]
    wide = {"w", "b"}  # handed in as fp32 to `held` too
    for _ in range(2):
        for micro in range(2):
            grads = bf16_grads(P, g)
            mixed = {k: v.float() if k in wide else v for k, v in grads.items()}
            if micro == 0:  # "emb" has no first micro-batch: its final one is held
                mixed.pop("emb"), grads.pop("emb")
                with held.accumulate(), fp32.accumulate():
                    hand_in(held, P, mixed, path, rngs[0])
                    hand_in(fp32, Q, upcast(grads), path, rngs[1])
            else:
                hand_in(held, P, mixed, path, rngs[0])
                hand_in(fp32, Q, upcast(grads), path, rngs[1])
        assert P["emb"].grad is None and all(p.grad is not None for k, p in P.items() if k != "emb")
        held.step(), fp32.step()
        assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), seed
        held.zero_grad(), fp32.zero_grad()
    held.synchronize(), fp32.synchronize()
    assert_same(P, Q, held, fp32, seed)
    n_emb = P["emb"].numel()
    rest = sum(p.numel() for p in P.values()) - n_emb
    assert held.grad_buffer_bytes() == 4 * rest + 2 * n_emb
    assert fp32.grad_buffer_bytes() == 4 * (rest + n_emb)


def test_autograd_gradient_after_a_held_one_is_summed_like_fp32(seed):
    """A p.grad that autograd sets after the hold is summed with it in step(), as autograd
    would have summed into the fp32 buffer."""
    P = problem(seed)
    Q = twin(P)
    held, fp32 = mo.AdamW(groups(P), max_grad_norm=0.5), mo.AdamW(groups(Q), max_grad_norm=0.5)
    grads = bf16_grads(P, torch.Generator().manual_seed(seed))
    hand_in(held, P, grads, "submit")
    hand_in(fp32, Q, upcast(grads), "submit")
    x = torch.randn(P["w"].shape, generator=torch.Generator().manual_seed(seed + 2))
    (P["w"] * x).sum().backward()
    (Q["w"] * x).sum().backward()
    held.step(), fp32.step()
    assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), seed
    assert_same(P, Q, held, fp32, seed)


# ---- zero_grad, release, state_dict, checkpoints -------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_before_step_drops_or_zeroes_the_held_gradients(set_to_none, seed):
    P = problem(seed)
    Q = twin(P)
    held, fp32 = mo.AdamW(groups(P), max_grad_norm=0.5), mo.AdamW(groups(Q), max_grad_norm=0.5)
    g = torch.Generator().manual_seed(seed)
    for t in range(2):  # a normal step, then one whose gradients are zeroed before step()
        grads = bf16_grads(P, g)
        hand_in(held, P, grads, "submit")
        hand_in(fp32, Q, upcast(grads), "submit")
        if t == 1:
            held.zero_grad(set_to_none), fp32.zero_grad(set_to_none)
        held.step(), fp32.step()
        assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), seed
        held.zero_grad(), fp32.zero_grad()
    assert_same(P, Q, held, fp32, seed)
    # dropped: no update; zeroed: an update with a zero gradient (decay only), like fp32
    assert all(int(held.state[p]["step"]) == (1 if set_to_none else 2) for p in P.values())
    held.release_grad_buffers()
    assert held.grad_buffer_bytes() == 0


def test_state_dict_and_checkpoint_with_held_gradients(seed):
    """state_dict() between hand-in and step() (a held gradient pending), a checkpoint
    round trip into a fresh optimizer, and a deepcopy all continue bitwise like fp32."""
    P = problem(seed)
    Q = twin(P)
    held, fp32 = mo.AdamW(groups(P), max_grad_norm=0.5), mo.AdamW(groups(Q), max_grad_norm=0.5)
    g = torch.Generator().manual_seed(seed)
    for t in range(2):
        grads = bf16_grads(P, g)
        hand_in(held, P, grads, "submit")
        hand_in(fp32, Q, upcast(grads), "submit")
        sd = held.state_dict()  # while held gradients wait: the state of t steps
        assert {int(s["step"]) for s in sd["state"].values()} == ({t} if t else set())
        held.step(), fp32.step()
        held.zero_grad(), fp32.zero_grad()
    assert all(p.grad is None for p in P.values())
    buf = io.BytesIO()
    torch.save(held.state_dict(), buf)
    buf.seek(0)
    P2 = twin(P)
    resumed = mo.AdamW(groups(P2), max_grad_norm=0.5)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    copied = copy.deepcopy(held)
    P3 = {k: copied.param_groups[gi]["params"][i]
          for gi, names in enumerate(GROUP_NAMES) for i, k in enumerate(names)}
    grads = bf16_grads(P, g)
    for opt, params in ((resumed, P2), (copied, P3), (held, P)):
        hand_in(opt, params, grads, "submit")
        opt.step()
    hand_in(fp32, Q, upcast(grads), "submit")
    fp32.step()
    for opt, params in ((resumed, P2), (copied, P3), (held, P)):
        opt.synchronize()
        assert torch.equal(opt.last_grad_norm, fp32.last_grad_norm), seed
        assert_same(params, Q, opt, fp32, seed)


def test_device_paths_see_a_held_gradient(seed):
    """A held gradient counts as a host gradient for the device-side paths' checks."""
    P = problem(seed)
    opt = mo.AdamW(groups(P), max_grad_norm=0.5)
    hand_in(opt, P, bf16_grads(P, torch.Generator().manual_seed(seed)), "submit")
    assert "held for step()" in opt._params_blocker([P["w"]], final=False)
    opt.step()
    assert opt._params_blocker([P["w"]], final=False) is None


def test_a_piece_in_another_dtype_moves_the_gradient_to_fp32(seed):
    """Pieces held in bf16 until one comes in fp32: the gradient goes on in an fp32 p.grad
    from the exact upcast of what came so far, and the result stays that of fp32."""
    P = problem(seed, contiguous=True)
    Q = twin(P)
    held, fp32 = mo.AdamW(groups(P), max_grad_norm=0.5), mo.AdamW(groups(Q), max_grad_norm=0.5)
    grads = bf16_grads(P, torch.Generator().manual_seed(seed))
    flat = grads["odd"].reshape(-1)
    rng = torch.Generator().manual_seed(seed)
    cut = PIECE_ALIGN * int(torch.randint(1, 4099 // PIECE_ALIGN, (), generator=rng))
    held.submit_pieces([(P["odd"], 0, flat[:cut].clone())]).result()
    assert P["odd"].grad is None
    held.submit_pieces([(P["odd"], cut, flat[cut:].float())]).result()
    assert P["odd"].grad is not None and P["odd"].grad.dtype == torch.float32
    fp32.submit_pieces([(Q["odd"], 0, flat.float())]).result()
    rest = [k for k in P if k != "odd"]
    held.submit([P[k] for k in rest], [grads[k] for k in rest]).result()
    fp32.submit([Q[k] for k in rest], [grads[k].float() for k in rest]).result()
    held.step(), fp32.step()
    assert torch.equal(held.last_grad_norm, fp32.last_grad_norm), seed
    assert_same(P, Q, held, fp32, seed)


def test_the_norm_of_a_16_bit_gradient_is_bitwise_that_of_its_fresh_upcast(monkeypatch):
    """functional.grad_norm upcasts into a reused per-thread scratch: on fresh random
    gradients of shrinking and growing sizes (stale values beyond each one in the scratch),
    fp16 and bf16, contiguous or not, and past the scratch's limit, the norm is bitwise
    ``vector_norm(g.float())``, and the scratch does not grow past its limit."""
    import random

    from megatrain.optim import functional

    limit = random.randint(5_000, 20_000)
    monkeypatch.setattr(functional, "NORM_SCRATCH_MAX", limit)
    monkeypatch.delattr(functional._scratch, "norm_buf", raising=False)
    for _ in range(12):
        n = random.randint(1, 2 * limit)
        dtype = random.choice([torch.bfloat16, torch.float16])
        g = (torch.randn(n) * 10 ** random.uniform(-3, 3)).to(dtype)
        if random.random() < 0.3 and n > 4:
            g = g[: n - n % 4].view(-1, 4).t()  # not contiguous
        want = torch.linalg.vector_norm(g.float(), 2.0)
        assert torch.equal(functional.grad_norm(g), want), (n, dtype, g.is_contiguous())
    buf = getattr(functional._scratch, "norm_buf", None)
    assert buf is None or buf.numel() <= limit


def test_norm_threads_reduce_held_gradients_to_the_same_bits(monkeypatch):
    """optim/norms.py: many 16-bit gradients handed in faster than the norm threads reduce
    them (the worker waits for a free buffer), of shrinking and growing sizes, fp16 and bf16,
    contiguous or not, past the scratch limit, and fp32: each Future's norm is bitwise
    ``vector_norm(g.float())``, and the gradients are not changed."""
    import random

    from megatrain.optim import functional, norms

    limit = random.randint(5_000, 20_000)
    monkeypatch.setattr(functional, "NORM_SCRATCH_MAX", limit)
    pool = norms.NormThreads(random.randint(1, 3))
    grads = []
    for _ in range(40):
        n = random.randint(1, 2 * limit)
        dtype = random.choice([torch.bfloat16, torch.float16, torch.float32])
        g = (torch.randn(n) * 10 ** random.uniform(-3, 3)).to(dtype)
        if random.random() < 0.3 and n > 4:
            g = g[: n - n % 4].view(-1, 4).t()  # not contiguous
        grads.append((g, g.clone()))
    futures = [pool.norm(g) for g, _ in grads]
    for (g, before), f in zip(grads, futures):
        assert torch.equal(norms.resolved(f), torch.linalg.vector_norm(g.float(), 2.0))
        assert torch.equal(g, before)
    assert norms.norm_threads_for(2) == 1 and norms.norm_threads_for(16) == 4
