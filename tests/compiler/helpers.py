"""Shared helpers: train a model eagerly and through megatrain side by side."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import megatrain
from megatrain.plan.search import InfeasibleBudget, PlannerOptions, plan_step


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def train_side_by_side(model, batches, options, steps=3, lr=1e-3, device="cpu"):
    """Train `model` eagerly (on `device`) and a copy through megatrain; return both histories."""
    ref = copy.deepcopy(model).to(device)
    streamed = copy.deepcopy(model)
    step = compile_streamed(streamed, options)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.1)
    opt = torch.optim.AdamW(streamed.parameters(), lr=lr, weight_decay=0.1)
    out = {"loss_ref": [], "loss": [], "grads_ref": None, "grads": None}
    for i, (ids, labels) in enumerate(batches[:steps]):
        loss_ref = ref(ids.to(device), labels=labels.to(device))
        loss_ref.backward()
        loss = step(ids, labels=labels)
        assert loss.device.type == "cpu", "the loss must come back on the CPU"
        loss.backward()
        if i == 0:
            out["grads_ref"] = flat(p.grad for p in ref.parameters()).cpu()
            out["grads"] = flat(p.grad for p in streamed.parameters())
            for p in streamed.parameters():
                assert p.grad.device.type == "cpu" and p.grad.dtype == torch.float32
        out["loss_ref"].append(loss_ref.item())
        out["loss"].append(loss.item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    out["params_ref"] = flat(ref.parameters()).cpu()
    out["params"] = flat(streamed.parameters())
    out["plan"] = megatrain.explain(step)
    out["step"] = step
    return out


def assert_streams_each_weighted_region_once(plan) -> None:
    """A single-graph plan (`megatrain.explain(step)`) streams: every region with weights is
    fetched exactly once per pass that needs its weights."""
    graph = plan.graphs[0]
    weighted = {r.id for r in plan.regions if r.param_fqns}
    fw = [e for e in graph.forward_events if e.startswith("prefetch(")]
    bw = [e for e in graph.backward_events if e.startswith("prefetch(")]
    assert sorted(fw) == sorted(f"prefetch({i})" for i in weighted)
    assert len(bw) == len(set(bw))
    # Only the embedding lookup's region may skip the backward fetch (its gradient needs no weight).
    skipped = weighted - {int(e[9:-1]) for e in bw}
    assert all(plan.regions[i].name == "prologue" for i in skipped), skipped
    assert plan.prefetch_count == len(fw) + len(bw)
    assert "megatrain.prefetch" in plan.code and "megatrain.evict" in plan.code


def train_eager(model, batches, max_grad_norm=None, lr_decay=1.0):
    """A copy of `model` trained with torch.optim.AdamW (lr 3e-3, weight decay 0.1), one step
    per batch, clipping the global norm to `max_grad_norm` if given and multiplying the
    learning rate by `lr_decay` after each step: its flat parameters and losses."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for ids, labels in batches:
        loss = ref(ids, labels=labels)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm, foreach=False)
        losses.append(loss.item())
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= lr_decay
        opt.zero_grad()
    return dict(params=flat(ref.parameters()), losses=losses)


def train_megatrain(model, batches, options, *, max_grad_norm=None, accumulate=False, lr_decay=1.0):
    """`train_eager`'s run through the backend with megatrain.AdamW: a copy of `model`,
    compiled with `options`; with `accumulate` each batch's first row is a micro-batch of its
    own (inside opt.accumulate()). Returns the model, its optimizer, its flat parameters, the losses, the
    first graph's plan and, after each step(), how many updates were still deferred and the
    global gradient norm it clipped with (None without max_grad_norm)."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm)
    step = compile_streamed(model, options)
    losses, deferred, norms = [], [], []
    for ids, labels in batches:
        if accumulate:
            with opt.accumulate():
                (step(ids[:1], labels=labels[:1]) / 2).backward()
            ids, labels = ids[1:], labels[1:]
        loss = step(ids, labels=labels) / (2 if accumulate else 1)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        deferred.append(len({id(d) for d in opt._promised_to.values()}))
        norms.append(None if opt.last_grad_norm is None else float(opt.last_grad_norm))
        for group in opt.param_groups:
            group["lr"] *= lr_decay
        opt.zero_grad()
    opt.synchronize()
    return dict(model=model, opt=opt, params=flat(model.parameters()), losses=losses, deferred=deferred, norms=norms,
                plan=megatrain.explain(step).graphs[0], step=step)


SMALL_VOCAB = 160


def small_llama_config(layers: int = 3, tied: bool = False):
    """The runtime options' CPU tests' Llama: 64 wide, vocab SMALL_VOCAB, ~0.3 M parameters,
    small enough to compile in seconds, with every kind of region (embedding, layers, head)."""
    from megatrain.models import LlamaConfig

    return LlamaConfig(vocab_size=SMALL_VOCAB, hidden=64, layers=layers, heads=4, kv_heads=2, ffn=176,
                       rope_theta=10000.0, tie_embeddings=tied)


def breaking_llama(where: str, config):
    """A Llama whose head is tied to the embedding by hand (F.linear with its weight), with a
    graph break `where`: "inside the layer loop" (after layer 1: dynamo compiles the layer's
    forward once and runs it for every layer after the break) or "after the embedding" (two
    graphs hand in gradients of the tied weight)."""
    from megatrain.models import Llama

    class Breaking(Llama):
        def forward(self, input_ids, labels=None):
            x = self.embed_tokens(input_ids)
            if where == "after the embedding":
                torch._dynamo.graph_break()
            cos, sin = self.rotary(x, input_ids.shape[1])
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin)
                if i == 1 and where == "inside the layer loop":
                    torch._dynamo.graph_break()
            logits = torch.nn.functional.linear(self.norm(x), self.embed_tokens.weight)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return Breaking(config)


def random_batches(vocab: int, n: int, batch: int, seq: int, generator=None):
    return [(torch.randint(0, vocab, (batch, seq), generator=generator),
             torch.randint(0, vocab, (batch, seq), generator=generator)) for _ in range(n)]


def cpu_peak_bytes(run) -> int:
    """Peak bytes the CPU allocator held while `run()` ran, beyond what it held before:
    the profiler's allocation events, replayed in time order. Garbage is collected first:
    a cycle from earlier work freed mid-run would count as negative bytes and hide part of
    the peak. Measure a step after the compiling one: Dynamo's first call keeps its frames
    (and with them the model's outputs) in reference cycles until the collector runs."""
    gc.collect()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def least_budgets(schedule) -> dict[bool, int]:
    """The least gpu_memory of a compiled graph's step (`explain(...).graphs[i].schedule`)
    without (False) and with (True) boundary activations offloaded: the peaks of the
    leanest plans, as the planner's refusal of a 1-byte budget names them."""
    need = {}
    for offload in (False, True):
        with pytest.raises(InfeasibleBudget) as info:
            plan_step(schedule.plan.schedule.problem, 1, schedule.rates, options=PlannerOptions(offload=offload))
        need[offload] = info.value.min_budget
    return need


def _split_knobs(options: dict | None) -> tuple[dict, dict]:
    """`options` as (the user's options, the decision knobs of megatrain.config)."""
    options = dict(options or {})
    return options, {k: options.pop(k) for k in list(options) if k in megatrain.config.DECISIONS}


class _Forced:
    """A model compiled with `backend="megatrain"`, each call made under
    `megatrain.config.patch(**knobs)`: the graphs compile (on a call) with those decisions."""

    def __init__(self, compiled, knobs: dict):
        self._compiled, self._knobs = compiled, knobs
        self._orig_mod = getattr(compiled, "_orig_mod", compiled)

    def __call__(self, *args, **kwargs):
        with megatrain.config.patch(**self._knobs):
            return self._compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._compiled, name)


def compile_streamed(model, options: dict | None = None):
    """`torch.compile(model, backend="megatrain")` with `options`' user options; its decision
    knobs (lowering, updates, prefetch, ...: megatrain.config.DECISIONS) are forced through
    megatrain.config around every call, as tests and benchmarks must force them."""
    options, knobs = _split_knobs(options)
    compiled = torch.compile(model, backend="megatrain", options=options)
    return _Forced(compiled, knobs) if knobs else compiled


def parse_forced(options: dict):
    """`parse_options` of `options`' user options, with its decision knobs forced through
    megatrain.config (where the backend reads them), validated alike."""
    from megatrain.compiler.options import parse_options

    options, knobs = _split_knobs(options)
    with megatrain.config.patch(**knobs):
        return parse_options(options)
