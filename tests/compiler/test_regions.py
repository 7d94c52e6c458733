"""Region assignment: module paths from dynamo's stacks (layers in real models: test_hf_zoo)."""

from __future__ import annotations

import warnings

import pytest

from megatrain.compiler.regions import module_path


@pytest.mark.parametrize("raw, path", [
    ("L['self'].layers[3]", "layers.3"),
    ("L['self'].layers.3.mlp", "layers.3.mlp"),
    ("L['args'][0].model.layers.0", "model.layers.0"),  # a decorated forward(*args)
    ("L['self']._modules['layers']._modules['0']", "layers.0"),
    ("getattr(L['self'].layers, '2')", "layers.2"),
    ("L['model'].h.11", "h.11"),
    ("L['self']", ""),
])
def test_module_path(raw, path):
    assert module_path(raw) == path


# -- layers in any container, and a block called several times --------------------------

import copy  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import megatrain  # noqa: E402

from .helpers import compile_streamed, flat, param_bytes, rel  # noqa: E402

WIDTH, BLOCKS = 128, 6


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class _InDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": _Block() for i in range(BLOCKS)})

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return x.pow(2).mean()


class _AsAttributes(nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(BLOCKS):
            setattr(self, f"layer{i}", _Block())

    def forward(self, x):
        for i in range(BLOCKS):
            x = getattr(self, f"layer{i}")(x)
        return x.pow(2).mean()


class _OneBlockFourTimes(nn.Module):
    """Weights shared across depth: one block called four times, between two projections."""

    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(WIDTH, WIDTH), _Block(), nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.embed(x)
        for _ in range(4):
            x = self.block(x)
        return self.head(x).pow(2).mean()


class _ListTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(BLOCKS))

    def forward(self, x):
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x.pow(2).mean()


class _Flat(nn.Module):
    """No repeated structure at all: three modules of three classes."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.norm = nn.LayerNorm(4 * WIDTH)
        self.down = nn.Bilinear(4 * WIDTH, 4 * WIDTH, 1)

    def forward(self, x):
        h = torch.tanh(self.norm(self.up(x)))
        return self.down(h, h).pow(2).mean()


CONTAINERS = {
    "ModuleDict": (_InDict, [f"blocks.b{i}" for i in range(BLOCKS)], 0.5),
    "attributes": (_AsAttributes, [f"layer{i}" for i in range(BLOCKS)], 0.5),
    # Each call is a region that streams the block again: the device holds one call's
    # weights and gradients at a time, never the four calls' (checked below).
    "one block called four times": (_OneBlockFourTimes, ["block", "block@1", "block@2", "block@3"], 1.5),
    "ModuleList looped twice": (_ListTwice, [f"layers.{i}{s}" for s in ("", "@1") for i in range(BLOCKS)], 0.5),
}


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_layers_are_found_in_any_container_and_each_call_streams_alone(name):
    build, layers, fraction = CONTAINERS[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    budget = int(fraction * param_bytes(model))
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager", "gpu_memory": budget})
    opt, opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i in range(3):
        x = torch.randn(8, WIDTH)
        loss, loss_ref = step(x), ref(x)
        loss.backward()
        loss_ref.backward()
        assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item()), i
        if i == 0:
            assert rel(flat(p.grad for p in model.parameters()), flat(p.grad for p in ref.parameters())) < 1e-5
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    assert rel(flat(model.parameters()), flat(ref.parameters())) < 1e-4
    plan = megatrain.explain(step)
    (graph,) = plan.graphs
    assert [r.name for r in graph.regions if r.kind == "layer"] == layers
    weighted = {r.id for r in graph.regions if r.param_fqns}
    for members in graph.schedule.units.values():
        assert sum(1 for m in members if m in weighted) <= 1, members
    assert plan.measured_peak_bytes <= budget
    if isinstance(model, _OneBlockFourTimes):  # weights shared across depth: not a copy per call
        assert budget < 4 * param_bytes(model.block)


def test_a_graph_without_repeated_structure_warns_once_naming_the_largest_module():
    model = _Flat()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                     "gpu_memory": 1 << 30})
    with pytest.warns(UserWarning, match=r"no repeated structure.*module 'down' holds the most"):
        step(torch.randn(4, WIDTH)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch._dynamo.reset()
        compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                  "gpu_memory": 1 << 30})(torch.randn(4, WIDTH)).backward()


def test_a_refusal_of_a_graph_without_repeated_structure_says_why():
    from megatrain.errors import MegatrainValueError

    model = _Flat()
    budget = int(0.9 * param_bytes(model))
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                     "gpu_memory": budget})
    with pytest.raises(MegatrainValueError, match="no repeated structure"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(torch.randn(4, WIDTH))


def test_regions_that_must_stream_together_are_explained(monkeypatch):
    """With the recompute rules undone (problem.py), phi's iota mask recomputed inside the
    last layer's backward joins every region into one unit: the refusal of a budget under
    the weights says which regions, which node and which weight join them."""
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    from megatrain.compiler import problem
    from megatrain.errors import MegatrainValueError

    from .test_hf_zoo import _phi, tokens

    monkeypatch.setattr(problem, "_absorb_sandwiched", lambda runs: runs)
    monkeypatch.setattr(problem._Graph, "_split_shared_fetches", lambda self, graph: False)
    torch.manual_seed(0)
    model = _phi()
    step = compile_streamed(model, {"device": "cpu", "precision": "fp32", "lowering": "eager",
                                     "gpu_memory": int(0.49 * param_bytes(model))})
    with pytest.raises(MegatrainValueError, match=r"Note: regions 'prologue', 'model\.layers\.0', .* stream their "
                                                  r"weights together.* because in the backward graph, .* reads "
                                                  r"weight 'model\.layers\.\d\.\S+' fetched for it at node"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(**tokens())
