"""A graph dynamo calls for several modules computes each call with that call's weights.

A graph break inside a layer makes dynamo compile the layer's halves once and call them for
every layer, each call with its own parameters. The runtime fetches a graph's first region
early, while the graph before it still runs (prefetch across graphs); that early buffer may
hold the previous call's parameters. These tests fail if such a buffer is used, or if the
runtime's safety net lets a foreign or stale buffer through.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import megatrain
from megatrain.runtime import streamer as streamer_mod

from .helpers import compile_streamed, flat, rel


class _SplitLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        x = x + torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return x + torch.tanh(self.b(x))


class _SplitStack(nn.Module):
    def __init__(self, width: int = 32, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(_SplitLayer(width) for _ in range(layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def _train(model, steps, options, fast_path, misses=None):
    step = compile_streamed(model, options)
    opt = (megatrain.AdamW if fast_path else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for i in range(steps):
        loss = step(torch.randn(8, 32, generator=torch.Generator().manual_seed(i)))
        loss.backward()
        if misses is not None:
            misses.extend(g.streamer.stats.early_misses for g in megatrain.explain(step).graphs)
        if i == 0 and not fast_path:
            grads = flat(p.grad for p in model.parameters())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    if fast_path:
        opt.synchronize()
    return losses, grads


def _eager(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for i in range(steps):
        loss = model(torch.randn(8, 32, generator=torch.Generator().manual_seed(i)))
        loss.backward()
        if i == 0:
            grads = flat(p.grad for p in model.parameters())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads


OPTIONS = {"device": "cpu", "precision": "fp32", "gpu_memory": 1 << 30, "lowering": "eager"}


@pytest.mark.filterwarnings("ignore:megatrain. the model has a graph break")
@pytest.mark.parametrize("fast_path", [False, True], ids=["torch AdamW", "megatrain.AdamW"])
def test_a_break_inside_each_layer_trains_each_layer_with_its_own_weights(fast_path):
    torch.manual_seed(0)
    model = _SplitStack()
    ref = copy.deepcopy(model)
    want_losses, want_grads = _eager(ref, 3)
    misses = []
    got_losses, got_grads = _train(model, 3, OPTIONS, fast_path, misses)
    assert sum(misses) > 0, "the test must reach an early fetch made for another layer's weights"
    for got, want in zip(got_losses, want_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (got_losses, want_losses)
    if not fast_path:
        assert rel(got_grads, want_grads) < 1e-5
    assert rel(flat(model.parameters()), flat(ref.parameters())) < 1e-4


@pytest.mark.filterwarnings("ignore:megatrain. the model has a graph break")
def test_the_safety_net_refuses_a_buffer_fetched_for_other_parameters(monkeypatch):
    """Were the runtime to hand a region the early buffer of another call's parameters (the
    bug this file guards against), the always-on check at `wait` raises, naming the region."""
    def careless_prefetch(self, region, host_params):
        early = self._early.pop(region, None)
        self._host_params[region] = host_params
        self._requested[region].append(host_params)
        if self._awaiting_first:
            self._first[self._phase] = (region, list(host_params))
            self._awaiting_first = False
        self._inflight[region].append(early if early is not None else self._start_fetch(region, host_params))

    monkeypatch.setattr(streamer_mod.Streamer, "prefetch", careless_prefetch)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"region '.*' would compute with weights it was not fetched "
                                           r"for: the buffer holds other parameters"):
        _train(_SplitStack(), 2, OPTIONS, fast_path=False)


def test_the_debug_check_compares_every_fetched_buffer_with_its_master(monkeypatch):
    """megatrain.config.check_fetched_weights: a training run passes it, and a buffer whose
    bits differ from the host master (a corrupted copy) is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)), nn.Linear(32, 1))
    loss_of = lambda m: (lambda x: m(x).pow(2).mean())  # noqa: E731
    with megatrain.config.patch(check_fetched_weights=True):
        step = compile_streamed(loss_of(model), OPTIONS)
        step(torch.randn(4, 32)).backward()

        start = streamer_mod.Streamer._start_fetch

        def corrupting(self, region, host_params):
            entry = start(self, region, host_params)
            entry.flat[0] += 1.0
            return entry

        monkeypatch.setattr(streamer_mod.Streamer, "_start_fetch", corrupting)
        torch._dynamo.reset()
        step = compile_streamed(loss_of(copy.deepcopy(model)), OPTIONS)
        with pytest.raises(RuntimeError, match="differs from its host master"):
            step(torch.randn(4, 32))


def test_config_patch_names_the_knobs_when_one_is_unknown():
    with pytest.raises(AttributeError, match="check_fetched_weights"):
        with megatrain.config.patch(no_such_knob=1):
            pass
