"""The cost model's per-unit device work: memory-bound traffic counted as Inductor fuses it
(one read of each outside input and one write of each result read outside, per connected
group of pointwise ops), FLOPs of the products, against hand counts on fresh shapes."""

from __future__ import annotations

import random

import sympy
import torch
import torch.fx as fx
from torch._subclasses import FakeTensorMode

from megatrain.compiler import op_costs

aten = torch.ops.aten


def _build(make):
    """An FX graph from `make(g, node)`, with every node's fake value set by running it."""
    fake = FakeTensorMode()
    g = fx.Graph()
    env = {}

    def node(target, *args):
        n = g.call_function(target, args)
        with fake:
            n.meta["val"] = target(*[env[a] if isinstance(a, fx.Node) else a for a in args])
        env[n] = n.meta["val"]
        return n

    def placeholder(name, *shape, dtype=torch.float32):
        n = g.placeholder(name)
        with fake:
            n.meta["val"] = env[n] = torch.empty(*shape, dtype=dtype)
        return n

    outputs = make(node, placeholder)
    g.output(tuple(outputs))
    return list(g.nodes)


def _traffic(nodes, owner):
    return {u: int(v) for u, v in op_costs.traffic(nodes, owner, torch.device("cpu"),
                                                   lambda s: sympy.Integer(int(s))).items()}


def test_a_fused_chain_reads_its_inputs_once_and_writes_what_others_read():
    rng = random.Random()
    t, h, f = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 30)
    names = {}

    def make(node, placeholder):
        x = placeholder("x", t, h)
        w1 = placeholder("w1", f, h)
        w2 = placeholder("w2", h, f)
        a = node(aten.mm.default, x, node(aten.t.default, w1))  # [t, f]: a product
        b = node(aten.relu.default, a)  # pointwise: reads a
        c = node(aten.mul.Tensor, b, b)  # same group; b not read outside
        d = node(aten.mm.default, c, node(aten.t.default, w2))  # [t, h]: c is read outside
        e = node(aten.add.Tensor, d, x)  # residual: reads d and x, writes e (output)
        names.update(a=a, b=b, c=c, d=d, e=e)
        return [e]

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    four = 4  # fp32
    # group {relu, mul}: reads a [t, f], writes c [t, f]; group {add}: reads d and x, writes e
    expected = four * (t * f + t * f) + four * (t * h + t * h + t * h)
    assert _traffic(nodes, owner) == {0: expected}
    # Split across units, the add's group is the other unit's alone
    owner[names["e"]] = 1
    assert _traffic(nodes, owner) == {0: four * 2 * t * f, 1: four * 3 * t * h}
    # The products' FLOPs come from torch's formulas; pointwise ops have none
    assert op_costs.flops(names["a"]) == 2 * t * h * f and op_costs.flops(names["b"]) == 0


def test_views_read_what_they_see_and_broadcasts_what_they_come_from():
    rng = random.Random()
    t, h = rng.randint(4, 40), rng.randint(2, 30)

    def make(node, placeholder):
        x = placeholder("x", t, h)
        scale = placeholder("scale", h)
        half = node(aten.slice.Tensor, x, 0, 0, t // 2)  # reads [t // 2, h] of x
        wide = node(aten.expand.default, scale, [t // 2, h])  # a broadcast of [h]
        y = node(aten.mul.Tensor, half, wide)
        z = node(aten._to_copy.default, y)  # a cast in the same group
        return [z]

    nodes = _build(make)
    owner = {n: 0 for n in nodes if n.op == "call_function"}
    assert _traffic(nodes, owner) == {0: 4 * ((t // 2) * h + h + (t // 2) * h)}


def test_grouped_products_count_each_groups_share():
    """aten._grouped_mm in its four layouts (a mixture of experts' forward and backward)
    against the sum of each group's own product, on random group sizes (bf16, dims a
    multiple of 8: what its meta function accepts)."""
    rng = random.Random()
    groups = rng.randint(2, 6)
    m, k, n = (8 * rng.randint(1, 4) for _ in range(3))
    total = 8 * rng.randint(groups + 1, 12)
    cuts = sorted(rng.sample(range(1, total), groups - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]   # each group's share of `total`
    offs = torch.tensor(cuts + [total], dtype=torch.int32)
    layouts = [  # (a, b, offs, the FLOPs of the groups' products one by one)
        ((total, k), (groups, k, n), True, sum(2 * s * k * n for s in sizes)),   # experts' forward
        ((m, total), (total, n), True, sum(2 * m * s * n for s in sizes)),       # a weight gradient
        ((groups, m, k), (k, total), True, sum(2 * m * k * s for s in sizes)),
        ((groups, m, k), (groups, k, n), False, 2 * groups * m * k * n),
    ]
    for a_shape, b_shape, grouped, expected in layouts:
        fake = FakeTensorMode()
        g = fx.Graph()
        tensors = [torch.randn(a_shape, dtype=torch.bfloat16), torch.randn(b_shape, dtype=torch.bfloat16)]
        if grouped:
            tensors.append(offs)
        args = []
        for name, x in zip(("a", "b", "offs"), tensors):
            p = g.placeholder(name)
            p.meta["val"] = fake.from_tensor(x)
            args.append(p)
        mm = g.call_function(aten._grouped_mm.default, tuple(args))
        with fake:
            mm.meta["val"] = aten._grouped_mm.default(*[p.meta["val"] for p in args])
        assert op_costs.flops(mm) == expected, (a_shape, b_shape)
