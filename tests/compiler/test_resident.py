"""AdamW state kept on the device between steps (updates="resident"): megatrain.optim.resident,
megatrain.runtime.resident_regions and the sites in megatrain.compiler.update_sites.

On the CPU device the resident state is a second set of CPU tensors updated by the same
kernel, so updates="resident" trains bitwise like updates="host"; what these tests add is
that the device copies really are the ones training (the host copies are stale until
synchronize()), and that every way out (accumulation, clipping, load_state_dict, a host
write, another graph) loses nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.models import Llama
from megatrain.optim import resident as resident_mod

from .helpers import compile_streamed, SMALL_VOCAB as VOCAB
from .helpers import flat, random_batches, rel, small_llama_config, train_eager


def llama(tied: bool = False, layers: int = 2) -> Llama:
    return Llama(small_llama_config(layers, tied))


@pytest.fixture(autouse=True)
def no_cached_rates(tmp_path, monkeypatch):
    """Compile with the default CPU rates, whatever this machine has cached."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))


def compiled(model, updates, *, max_grad_norm=None, skip_nonfinite=False, **options):
    torch._dynamo.reset()
    opt = megatrain.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm,
                          skip_nonfinite=skip_nonfinite)
    step = compile_streamed(model, {
        "device": "cpu", "precision": "fp32", "lowering": "eager", "updates": updates, **options})
    return opt, step


def run(step, opt, batches):
    losses = []
    for ids, labels in batches:
        loss = step(ids, labels=labels)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def train(model, updates, batches, **kw):
    model = copy.deepcopy(model)
    opt, step = compiled(model, updates, **kw)
    losses = run(step, opt, batches)
    opt.synchronize()
    plan = megatrain.explain(step).graphs[0]
    return dict(params=flat(model.parameters()), losses=losses, plan=plan, opt=opt, model=model,
                resident=plan.streamer.resident)


def side_by_side(model, scenario, **options):
    """``scenario(model copy, optimizer, compiled step, updates)`` with updates="resident"
    and with "host", each on a fresh copy of ``model``: what each returned, by updates."""
    out = {}
    for updates in ("resident", "host"):
        streamed = copy.deepcopy(model)
        opt, step = compiled(streamed, updates, **options)
        out[updates] = scenario(streamed, opt, step, updates)
    return out


def residency_costs(model, batches):
    """A roomy host-path plan of ``model`` (prefetch 0) and what residency needs beside it:
    the plan, resident bytes per region with parameters (by id), the upcast scratch."""
    plan = train(model, "host", batches, prefetch=0)["plan"]
    params = dict(model.named_parameters())
    need = {r.id: resident_mod.resident_bytes([params[f].shape for f in r.param_fqns])
            for r in plan.regions if r.param_fqns}
    return plan, need, 4 * resident_mod.upcast_scratch_numel(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied,precision", [(False, "fp32"), (True, "fp32"), (False, "bf16")])
def test_resident_trains_bitwise_like_host_and_like_eager(tied, precision):
    torch.manual_seed(0)
    model = llama(tied)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    host = train(model, "host", batches, precision=precision)
    res = train(model, "resident", batches, precision=precision)
    assert torch.equal(res["params"], host["params"]) and res["losses"] == host["losses"]
    if precision == "fp32":
        ref = train_eager(model, batches)
        assert all(abs(a - b) / abs(b) < 1e-5 for a, b in zip(res["losses"], ref["losses"]))
        assert rel(res["params"], ref["params"]) < 1e-3
    sites = res["plan"].update_sites
    # A tied embedding's gradient comes in two pieces, one from each region that reads it:
    # the first waits on the device and the second completes it, the host path's sum
    assert {r for r, s in sites.items() if s == "resident"} == set(sites)
    per_step = sum(len(pids) for pids in res["resident"].regions.values())  # a tied one twice
    assert res["resident"].updates == 3 * per_step > 0 and not res["resident"].demoted
    assert res["plan"].streamer.last_stats.fetch_paths["resident"] > 0


def test_the_predicted_step_leaves_resident_regions_off_the_host():
    """explain's predicted step is the plan as the runtime runs it: the planner chose its
    schedule counting every update on the host; resident regions then fetch, copy and
    update nothing over the link or on the host. Same schedule, same peak, less time."""
    torch.manual_seed(8)
    model = llama(layers=3)
    batches = random_batches(VOCAB, 1, batch=2, seq=16)
    host, res = (train(model, updates, batches)["plan"] for updates in ("host", "resident"))
    assert host.predicted_schedule is host.schedule.plan.schedule
    planned, sited = res.schedule.plan.schedule, res.predicted_schedule
    assert planned.config == host.schedule.plan.config and planned.step_time == pytest.approx(
        host.predicted_step_s)
    assert sited.config == planned.config and sited.peak_bytes == planned.peak_bytes
    resident_weights = {pid for r, s in res.update_sites.items() if s == "resident" for pid in res.update_params[r]}
    assert resident_weights and all(w.numel == 0 and w.link_nbytes == 0 for w in sited.problem.weights
                                    if w.id in resident_weights)

    def busy(s, stream):
        return sum(s.end[t] - s.start[t] for t in s.streams[stream])

    assert busy(sited, "h2d") < busy(planned, "h2d") and busy(sited, "host") < busy(planned, "host")
    assert res.predicted_step_s == sited.step_time < planned.step_time


def test_host_copies_are_stale_until_read():
    """The device copies are the ones training: the host parameters still hold their
    initial values until something reads the model. opt.state_dict() makes them and the
    host state the host path's and keeps the regions resident; synchronize() sends them
    home, and the next fetch adopts them afresh."""
    torch.manual_seed(1)
    model = llama()
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    host = train(model, "host", batches)
    streamed = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in streamed.named_parameters()}
    opt, step = compiled(streamed, "resident")
    run(step, opt, batches)
    kept = [n for n, p in streamed.named_parameters() if opt.is_resident(p)]
    assert kept and all(torch.equal(dict(streamed.named_parameters())[n], initial[n]) for n in kept)
    state = opt.state_dict()
    assert torch.equal(flat(streamed.parameters()), host["params"])
    ref = host["opt"].state_dict()
    for i, st in state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], ref["state"][i][key]), (i, key)
    assert all(opt.is_resident(p) for n, p in streamed.named_parameters() if n in kept)
    opt.synchronize()
    assert not any(opt.is_resident(p) for p in streamed.parameters())
    run(step, opt, batches[:1])
    assert all(opt.is_resident(p) for n, p in streamed.named_parameters() if n in kept)


def test_every_way_of_reading_the_model_sees_what_the_host_plan_sees(tmp_path):
    """The rule users rely on: with regions resident, model.state_dict() (no synchronize),
    opt.state_dict(), the main job's checkpoint, evaluation through the compiled model and
    model.parameters() after opt.synchronize() read bitwise what the host-only plan reads;
    and reading keeps the regions resident (training goes on without re-uploading them)."""
    from safetensors.torch import load_file

    from megatrain.train import checkpoint, hf

    torch.manual_seed(11)
    model = llama()
    batches = random_batches(VOCAB, 5, batch=2, seq=16)

    def read_every_way(streamed, opt, step, updates):
        def still_resident():
            return sum(opt.is_resident(p) for p in streamed.parameters())

        out = {}
        run(step, opt, batches[:1])
        resident = still_resident()
        assert (resident > 0) == (updates == "resident")
        out["model.state_dict()"] = {k: v.clone() for k, v in streamed.state_dict().items()}
        run(step, opt, batches[1:2])
        out["opt.state_dict()"] = copy.deepcopy(opt.state_dict()["state"])
        run(step, opt, batches[2:3])
        folder = checkpoint.save_checkpoint(tmp_path / updates, 3, streamed, opt, {}, {})
        out["checkpoint weights"] = {k: v for f in hf.weight_files(folder) for k, v in load_file(f).items()}
        out["checkpoint optimizer"] = torch.load(folder / "optimizer.pt")["state"]
        assert still_resident() == resident
        run(step, opt, batches[3:4])
        with torch.no_grad():
            out["evaluation"] = step(batches[4][0], labels=batches[4][1])
        assert still_resident() == resident
        opt.synchronize()
        out["parameters after synchronize()"] = flat(streamed.parameters())
        return out

    got = side_by_side(model, read_every_way)
    for way, want in got["host"].items():
        assert_bitwise_equal(got["resident"][way], want, way)


def assert_bitwise_equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert torch.equal(a, b), where


@pytest.mark.parametrize("how,tied", [
    ("micro-batches", False), ("clipping", False), ("micro-batches clipped", False),
    ("non-finite check", False),
    # a tied embedding: its pieces wait on the device (clipping), or go home (micro-batches)
    ("clipping", True), ("micro-batches", True)])
def test_gradients_that_must_wait_wait_on_the_device_and_stay_exact(how, tied):
    """Inside accumulate(), with max_grad_norm or skip_nonfinite the update cannot run at
    the hand-off: the gradients are summed in a device buffer lent from the reserve (the
    host path's p.grad), and step() clips and applies them there, norms stacked in
    param-group order with the host's: bitwise like the host path on the CPU. A tied
    embedding's two pieces per backward are summed there too."""
    torch.manual_seed(2)
    model = llama(tied, layers=1)
    batches = random_batches(VOCAB, 3, batch=2, seq=8)
    micro = "micro-batches" in how
    options = dict(max_grad_norm=0.05 if "clipped" in how or how == "clipping" else None,
                   skip_nonfinite=how == "non-finite check")

    def waiting(streamed, opt, step, updates):
        for ids, labels in batches:
            if micro:
                with opt.accumulate():
                    (step(ids[:1], labels=labels[:1]) / 2).backward()
                ids, labels = ids[1:], labels[1:]
            (step(ids, labels=labels) / (2 if micro else 1)).backward()
            opt.step()
            opt.zero_grad()
        resident = megatrain.explain(step).graphs[0].streamer.resident
        if updates == "resident" and tied and micro:
            # one backward's pieces of the tied embedding sum on the host before p.grad
            # takes them: its regions went home, the others stayed
            assert resident.regions and set(resident.demoted) == {0, max(resident.candidates)}, resident.demoted
        elif updates == "resident":
            assert resident.regions and not resident.demoted, resident.demoted
            # every gradient waited in a lent buffer (a tied one in its first region's)
            assert set(resident.buffered) <= set(resident.regions)
            lent = {p for r in resident.buffered for p in resident.regions[r]}
            assert all(set(pids) <= lent for pids in resident.regions.values())
            assert resident.updates == (2 if micro else 1) * 3 * sum(map(len, resident.regions.values()))
        opt.synchronize()
        if options["max_grad_norm"] is not None:
            assert opt.last_grad_norm is not None
        return flat(streamed.parameters()), opt.last_grad_norm

    out = side_by_side(model, waiting, **options)
    assert torch.equal(out["resident"][0], out["host"][0])
    if options["max_grad_norm"] is not None:
        assert torch.equal(out["resident"][1], out["host"][1])


def test_without_room_for_gradient_buffers_regions_go_home():
    """A region whose waiting gradients do not fit the reserve goes home for good: its
    bytes return (so a later region's buffer may then fit), and training continues
    bitwise like the host path."""
    torch.manual_seed(2)
    model = llama(layers=1)
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    roomy, need, scratch = residency_costs(model, batches[:1])
    budget = roomy.predicted_peak_bytes + scratch + sum(need.values()) + 1024  # state fits, buffers do not
    clipped = train(model, "resident", batches, prefetch=0, gpu_memory=budget, max_grad_norm=0.05)
    resident = clipped["resident"]
    assert resident.demoted and all("lend them buffers" in why for why in resident.demoted.values())
    assert set(resident.buffered) == set(resident.regions)
    assert resident.reserve.live == resident.held_bytes <= resident.reserve.nbytes
    host = train(model, "host", batches, prefetch=0, max_grad_norm=0.05)
    assert torch.equal(clipped["params"], host["params"])


def test_regions_sharing_a_weight_are_resident_together_or_not_at_all():
    """A tied embedding's two regions hold one state (counted once) and the buffers its
    first gradient piece waits in, booked when they are admitted: greedy from the end of
    the backward, they are resident together where both fit, else neither (here: room for
    the state but not the buffers), and no region admitted after them takes the buffers'
    room (so the pair is never sent home for want of them). At every budget the pool stays
    within gpu_memory and training is bitwise the host path."""
    import dataclasses

    torch.manual_seed(3)
    # a vocabulary large enough that the waiting buffers could hold a layer's state
    model = Llama(dataclasses.replace(small_llama_config(2, True), vocab_size=2048))
    batches = random_batches(VOCAB, 2, batch=2, seq=8)
    roomy, need, scratch = residency_costs(model, batches)
    params = dict(model.named_parameters())
    fqns = {r.id: r.param_fqns for r in roomy.regions if r.param_fqns}
    ends = {r for r in fqns for other in fqns if other != r and set(fqns[r]) & set(fqns[other])}
    assert len(ends) == 2, fqns
    tied = {f for r in ends for f in fqns[r]}
    tied_state = resident_mod.resident_bytes([params[f].shape for f in tied])
    waiting = sum(4 * sum(params[f].numel() for f in fqns[r]) for r in ends)
    host = train(model, "host", batches, prefetch=0)["params"]
    seen = set()
    others = min(v for r, v in need.items() if r not in ends)
    assert waiting > others, (waiting, others)  # what the middle room tests
    for room in (tied_state + waiting // 2, tied_state + waiting + others,
                 tied_state + waiting + sum(need.values())):
        res = train(model, "resident", batches, prefetch=0,
                    gpu_memory=roomy.predicted_peak_bytes + scratch + room)
        plan = res["plan"]
        kept = {r for r, s in plan.update_sites.items() if s == "resident"}
        left, expect = plan.update_reserve - scratch, set()
        if room < tied_state + waiting:  # the pair's state fits, its waiting buffers do not
            assert tied_state <= left < tied_state + waiting, (left, tied_state, waiting)
        for r in plan.regions:  # the forward's order: the end of the backward first
            if r.id not in need or r.id in expect or (r.id in ends and ends & expect):
                continue
            cost = tied_state + waiting if r.id in ends else need[r.id]
            if cost <= left:
                expect |= ends if r.id in ends else {r.id}
                left -= tied_state + waiting if r.id in ends else need[r.id]
        assert kept == expect and set(res["resident"].regions) == kept, (room, kept, expect)
        assert not res["resident"].demoted, res["resident"].demoted
        assert plan.streamer.pool.peak <= plan.budget
        assert torch.equal(res["params"], host)
        seen.add((bool(ends & kept), bool(kept - ends)))
    # the pair left out (its state fit, its buffers did not; a layer did), then in with others
    assert seen == {(False, True), (True, True)}, seen


def test_a_tied_gradient_refused_after_its_first_piece_is_an_error_not_a_hang():
    """Two backwards without opt.step() between: the second one's last piece of the tied
    embedding is refused on the device (it already had its last gradient this step) after
    the first piece was summed there; the host cannot complete that sum, so it says so."""
    torch.manual_seed(4)
    model = llama(tied=True, layers=1)
    opt, step = compiled(model, "resident")
    (ids, labels), = random_batches(VOCAB, 1, batch=2, seq=8)
    step(ids, labels=labels).backward()
    with pytest.raises(Exception, match="tied weight of shape .* summed on the device"):
        step(ids, labels=labels).backward()


@pytest.mark.parametrize("write", ["in place", "through .data"])
def test_host_writes_after_synchronize_are_seen_and_before_it_refused(write):
    """After synchronize() the host copies are the truth again, whatever writes them (an
    in-place op bumps the version counter, ``p.data`` does not); a write while the device
    holds newer values is refused where the version counter shows it."""
    torch.manual_seed(3)
    model = llama()
    batches = random_batches(VOCAB, 3, batch=2, seq=16)

    def halve_between_steps(streamed, opt, step, updates):
        run(step, opt, batches[:1])
        opt.synchronize()
        with torch.no_grad():
            for p in streamed.parameters():
                (p if write == "in place" else p.data).mul_(0.5)
        run(step, opt, batches[1:])
        opt.synchronize()
        trained = flat(streamed.parameters())
        if updates == "resident":
            run(step, opt, batches[:1])
            with torch.no_grad():  # the device holds newer values now: this write is refused
                next(streamed.parameters()).add_(1.0)
            with pytest.raises(RuntimeError, match=r"call opt.synchronize\(\) before"):
                step(*batches[0][:1], labels=batches[0][1])
        return trained

    out = side_by_side(model, halve_between_steps)
    assert torch.equal(out["resident"], out["host"])


def test_load_state_dict_is_adopted_afresh():
    """Restoring model and optimizer state and repeating a step gives that step again."""
    torch.manual_seed(4)
    model = llama()
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    streamed = copy.deepcopy(model)
    opt, step = compiled(streamed, "resident")
    run(step, opt, batches[:2])
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_model = copy.deepcopy(streamed.state_dict())
    run(step, opt, batches[2:])
    opt.synchronize()
    once = flat(streamed.parameters())
    streamed.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert not any(opt.is_resident(p) for p in streamed.parameters())
    run(step, opt, batches[2:])
    assert any(opt.is_resident(p) for p in streamed.parameters())
    opt.synchronize()
    assert torch.equal(flat(streamed.parameters()), once)


def test_resident_regions_fit_the_memory_the_plan_leaves():
    """With room for some regions only, the runtime keeps exactly those resident_sites
    picks (the end of the backward's order first), within the reserve, and places the rest
    like "auto"; the pool never exceeds gpu_memory."""
    torch.manual_seed(5)
    model = llama(layers=3)
    batches = random_batches(VOCAB, 2, batch=2, seq=8)
    roomy, need, scratch = residency_costs(model, batches)
    small = sorted(need.values())
    budget = roomy.predicted_peak_bytes + scratch + small[0] + small[1] + small[2] // 2
    tight = train(model, "resident", batches, prefetch=0, gpu_memory=budget)
    plan = tight["plan"]
    kept = {r for r, s in plan.update_sites.items() if s == "resident"}
    assert 0 < len(kept) < len(plan.update_sites)
    # Greedy from the end of the backward (the forward's order), skipping what does not fit.
    left, expect = plan.update_reserve - scratch, set()
    for r in plan.regions:
        if r.id in need and need[r.id] <= left:
            expect.add(r.id)
            left -= need[r.id]
    assert kept == expect
    assert set(tight["resident"].regions) == kept
    assert tight["resident"].reserve.live <= plan.update_reserve
    assert plan.streamer.pool.peak <= plan.budget
    assert torch.equal(tight["params"], train(model, "host", batches, prefetch=0)["params"])


def test_another_graph_placing_resident_regions_sends_the_first_home():
    torch.manual_seed(6)
    first, second = llama(), llama(layers=1)
    batches = random_batches(VOCAB, 2, batch=2, seq=16)
    ref = train(first, "host", batches)["params"]
    a = copy.deepcopy(first)
    opt_a, step_a = compiled(a, "resident")
    run(step_a, opt_a, batches[:1])
    resident_a = megatrain.explain(step_a).graphs[0].streamer.resident
    assert resident_a.regions
    b = copy.deepcopy(second)
    opt_b = megatrain.AdamW(b.parameters(), lr=3e-3)
    step_b = compile_streamed(b, {
        "device": "cpu", "precision": "fp32", "lowering": "eager", "updates": "resident"})
    graph_a = megatrain.explain(step_a).graphs[0]
    assert graph_a.predicted_schedule is not graph_a.schedule.plan.schedule
    run(step_b, opt_b, batches[:1])
    assert not resident_a.regions and resident_a.reserve.live == 0
    assert graph_a.predicted_schedule is graph_a.schedule.plan.schedule  # all updates home
    assert not any(opt_a.is_resident(p) for p in a.parameters())
    run(step_a, opt_a, batches[1:])
    opt_a.synchronize()
    assert torch.equal(flat(a.parameters()), ref)


def test_a_measured_step_lets_more_regions_become_resident():
    """Streamer.grow_reserve (on CUDA after the second step, with its allocator peak): the
    reserve grows to what the measured step left free and the next candidates become
    resident at their next fetch; training goes on bitwise like the host path."""
    torch.manual_seed(7)
    model = llama(layers=3)
    batches = random_batches(VOCAB, 3, batch=2, seq=8)
    roomy, need, scratch = residency_costs(model, batches[:1])
    least = min(need.values())
    streamed = copy.deepcopy(model)
    opt, step = compiled(streamed, "resident", prefetch=0,
                         gpu_memory=roomy.predicted_peak_bytes + scratch + least + least // 2)
    run(step, opt, batches[:1])
    graph = megatrain.explain(step).graphs[0]
    streamer = graph.streamer
    before, reserve = set(streamer.resident.regions), streamer.reserve.nbytes
    assert len(before) == 1
    predicted_before = graph.predicted_step_s
    streamer.grow_reserve(measured_peak=0)  # as if the step had needed nothing beside it
    assert streamer.reserve.nbytes > reserve
    assert before < set(streamer.resident.regions) <= set(streamer.resident.candidates)
    live = megatrain.explain(step).graphs[0].resident_regions
    assert live == dict.fromkeys(streamer.resident.regions, "resident")
    # explain's prediction follows the regions resident now, not the compile's choice
    assert set(r for r, s in graph.sites_now().items() if s == "resident") == set(streamer.resident.regions)
    assert graph.predicted_step_s < predicted_before
    assert streamer.reserve.live <= streamer.reserve.nbytes
    run(step, opt, batches[1:])
    assert all(opt.is_resident(params_of) for r in streamer.resident.regions
               for params_of in (streamer.params[i] for i in streamer.resident.regions[r]))
    # explain counts the parameters whose state the optimizer keeps on the device
    on_device = sum(p.numel() for p in streamed.parameters() if opt.is_resident(p))
    assert megatrain.explain(step).resident_params == on_device > 0
    opt.synchronize()
    assert torch.equal(flat(streamed.parameters()), train(model, "host", batches, prefetch=0)["params"])


def _peaks_over_budget_at_step(monkeypatch, streamer, step_index: int, over: int):
    """Stand in for the CUDA allocator's per-step peak on the CPU: ``over`` bytes above
    gpu_memory at the ``step_index``-th measured step (1-based), well below it otherwise."""
    count = {"n": 0}

    def peak():
        count["n"] += 1
        return streamer.pool.budget + over if count["n"] == step_index else 0

    monkeypatch.setattr(streamer, "_allocator_peak", peak)


def _every_region_resident(model, batch):
    """A copy of ``model`` compiled with room for every region's resident state, after one
    step (compiling; the first measured step is the next): copy, optimizer, step, streamer."""
    roomy, need, scratch = residency_costs(model, [batch])
    streamed = copy.deepcopy(model)
    opt, step = compiled(streamed, "resident", prefetch=0,
                         gpu_memory=roomy.predicted_peak_bytes + scratch + sum(need.values()))
    run(step, opt, [batch])
    return streamed, opt, step, megatrain.explain(step).graphs[0].streamer


def test_a_step_over_gpu_memory_sends_the_last_admitted_regions_home(monkeypatch):
    """Streamer.shrink_reserve (on CUDA from the second measured step on, with its allocator
    peak): a step over gpu_memory sends resident regions home at the next step's start,
    the last admitted first, as few as cover the excess over gpu_memory - gpu_memory/16,
    and the reserve shrinks by the excess; later steps keep that, and training goes on
    bitwise like the host path."""
    from megatrain.runtime.update_room import MEASURED_STEP, RESERVE_MARGIN

    torch.manual_seed(11)
    model = llama(layers=3)
    batches = random_batches(VOCAB, 5, batch=2, seq=8)
    streamed, opt, step, streamer = _every_region_resident(model, batches[0])
    admitted = list(streamer.resident.regions)
    assert len(admitted) >= 3, admitted
    held = dict(streamer.resident.held)
    budget, nbytes = streamer.pool.budget, streamer.reserve.nbytes
    margin = int(budget * RESERVE_MARGIN)
    # an excess (over gpu_memory, so above the margin) that the last k admitted regions
    # cover and the last k - 1 do not
    covered, k = 0, 0
    while covered <= margin:
        k, covered = k + 1, covered + held[admitted[-1 - k]]
    excess = max(margin, covered - held[admitted[-k]]) + 1
    assert 0 < k < len(admitted), (k, admitted)
    _peaks_over_budget_at_step(monkeypatch, streamer, MEASURED_STEP, excess - margin)
    run(step, opt, batches[1:1 + MEASURED_STEP])  # the last of them overran
    assert list(streamer.resident.regions) == admitted  # nothing moves mid-run
    run(step, opt, batches[1 + MEASURED_STEP:])  # these begin by shrinking
    assert list(streamer.resident.regions) == admitted[:-k]
    assert set(streamer.resident.demoted) == set(admitted[-k:])
    assert all("over gpu_memory" in why for why in streamer.resident.demoted.values())
    assert streamer.reserve.nbytes == nbytes - excess >= streamer.reserve.live
    live = megatrain.explain(step).graphs[0].resident_regions
    assert {r for r, where in live.items() if where == "resident"} == set(admitted[:-k])
    opt.synchronize()
    assert torch.equal(flat(streamed.parameters()), train(model, "host", batches, prefetch=0)["params"])


def test_an_overrun_beyond_the_resident_state_sends_all_home_and_warns(monkeypatch):
    """Where the excess is more than the resident state holds, every region goes home, the
    reserve keeps nothing, and a RuntimeWarning names the bytes still over and the fix;
    training goes on bitwise like the host path."""
    from megatrain.runtime.update_room import MEASURED_STEP

    torch.manual_seed(12)
    model = llama(layers=2)
    batches = random_batches(VOCAB, 4, batch=2, seq=8)
    streamed, opt, step, streamer = _every_region_resident(model, batches[0])
    assert streamer.resident.regions
    _peaks_over_budget_at_step(monkeypatch, streamer, MEASURED_STEP, streamer.pool.budget)
    run(step, opt, batches[1:1 + MEASURED_STEP])
    with pytest.warns(RuntimeWarning, match=r"no resident state is left to give back the other \d+ bytes"):
        run(step, opt, batches[1 + MEASURED_STEP:])
    assert not streamer.resident.regions and streamer.reserve.nbytes == streamer.reserve.live == 0
    opt.synchronize()
    assert torch.equal(flat(streamed.parameters()), train(model, "host", batches, prefetch=0)["params"])


@pytest.mark.parametrize("name", ["gpt2", "break after the embedding", "break inside the layer loop"])
def test_partial_fetches_and_graph_breaks_train_bitwise_like_host(name):
    """GPT-2's backward fetches only the weights it reads (a subset of a region): they come
    from the device masters too. A weight tied across a graph break gets a gradient from
    each graph: its regions go home (summed in p.grad), and the other graph's fetches of
    resident weights read current host copies."""
    from megatrain.models.gpt2 import GPT2, GPT2Config

    from .helpers import breaking_llama

    torch.manual_seed(8)
    if name == "gpt2":
        model = GPT2(GPT2Config(vocab_size=VOCAB, hidden=64, layers=2, heads=4, max_seq=32))
    else:
        model = breaking_llama(name.removeprefix("break "), small_llama_config(3, tied=True))
    batches = random_batches(VOCAB, 3, batch=2, seq=16)
    res = train(model, "resident", batches)
    assert torch.equal(res["params"], train(model, "host", batches)["params"])
    if name == "gpt2":
        assert res["resident"].updates > 0 and not res["resident"].demoted


def test_an_eval_graph_reads_the_newest_weights():
    """A no-grad call compiles a graph of its own, which fetches from the host: the newest
    device values are copied home first, and stay resident for training."""
    torch.manual_seed(9)
    model = llama()
    batches = random_batches(VOCAB, 3, batch=2, seq=16)

    def train_then_eval(streamed, opt, step, updates):
        run(step, opt, batches[:2])
        with torch.no_grad():
            loss = step(batches[2][0], labels=batches[2][1]).item()
        assert any(opt.is_resident(p) for p in streamed.parameters()) == (updates == "resident")
        return loss

    evals = side_by_side(model, train_then_eval)
    assert evals["resident"] == evals["host"]


def test_optimizer_state_alone_or_a_new_optimizer_keep_the_newest_weights():
    """An optimizer state_dict holds no weights: loading one keeps the device's newest
    weights (no model state was loaded). A new megatrain.AdamW over the same parameters
    takes over from the old one's newest values."""
    torch.manual_seed(10)
    model = llama()
    batches = random_batches(VOCAB, 3, batch=2, seq=16)

    def reload_and_replace(streamed, opt, step, updates):
        run(step, opt, batches[:1])
        saved = copy.deepcopy(opt.state_dict())
        run(step, opt, batches[1:2])
        opt.load_state_dict(saved)
        run(step, opt, batches[2:])
        fresh = megatrain.AdamW(streamed.parameters(), lr=3e-3, weight_decay=0.1)
        run(step, fresh, batches[:1])
        fresh.synchronize()
        return flat(streamed.parameters())

    out = side_by_side(model, reload_and_replace)
    assert torch.equal(out["resident"], out["host"])


@pytest.mark.parametrize("micro", [False, True], ids=["immediate", "micro-batches"])
def test_a_parameter_larger_than_the_scratch_is_updated_in_pieces_bitwise(monkeypatch, micro):
    """ResidentRegions upcasts bf16 gradients into a scratch of at most UPCAST_PIECE
    elements (the reserve holds no more), so a larger parameter is upcast and updated piece
    by piece: its step counted once, every bit as torch.optim.AdamW(fused=True) on the
    whole fp32 gradient, a non-contiguous gradient included; with micro-batches the second
    one is added to the device buffer piece by piece too."""
    from megatrain.optim import functional
    from megatrain.memory.pool import DevicePool, Reserve
    from megatrain.runtime.resident_regions import ResidentRegions

    piece = 3 * functional.PIECE_ALIGN
    monkeypatch.setattr(resident_mod, "UPCAST_PIECE", piece)
    seen = []  # elements per fused call of the resident updates
    fused = functional.adamw_at_step_
    monkeypatch.setattr(functional, "adamw_at_step_",
                        lambda ps, *a, **k: (seen.extend(p.numel() for p in ps), fused(ps, *a, **k)))
    g = torch.Generator().manual_seed(11)
    # Cut into pieces (a tail off PIECE_ALIGN; a transposed gradient), exactly one, less.
    shapes = [(37, 29), (1000,), (64, 3), (5, 7)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.5) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = megatrain.AdamW(params, lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    reserve = Reserve(DevicePool(1 << 30), 1 << 30)
    regions = ResidentRegions(torch.device("cpu"), params, {0: [0, 1, 2, 3]}, reserve)
    state = resident_mod.resident_bytes(shapes)
    assert regions.regions == {0: [0, 1, 2, 3]}
    assert regions.held_bytes == reserve.live == state + 4 * piece  # not 4 * 37 * 29
    assert regions.sources(0, params) is not None

    def bf16(shape):
        if len(shape) == 2 and shape[0] > 32:  # laid out transposed, like some matmul grads
            return torch.randn(shape[::-1], generator=g).to(torch.bfloat16).t()
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    for _ in range(3):
        grads = [bf16(s) for s in shapes]
        assert not grads[0].is_contiguous()
        if micro:
            first = [bf16(s) for s in shapes]
            with opt.accumulate():
                assert all(regions.take(x, 0, p) for p, x in zip(params, first))
            for q, x, y in zip(ref, first, grads):
                q.grad = x.float().contiguous() + y.float().contiguous()
        else:
            for q, x in zip(ref, grads):
                q.grad = x.float().contiguous()
        assert all(regions.take(x, 0, p) for p, x in zip(params, grads))
        opt.step()
        opt.zero_grad()
        torch_opt.step()
    assert not regions.demoted and regions.updates == (6 if micro else 3) * len(shapes)
    if micro:  # the summed gradients wait in fp32 device buffers: updated whole
        assert seen == 3 * [37 * 29, 1000, 192, 35]
    else:
        assert seen == 3 * ([piece] * 5 + [37 * 29 - 5 * piece] + [piece] * 5 + [1000 - 5 * piece]
                            + [192, 35])
    assert set(regions.buffered) == ({0} if micro else set())
    assert reserve.live == regions.held_bytes
    opt.synchronize()
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], torch_opt.state[q][key]), key
    assert float(opt.state[params[0]]["step"]) == 3
    regions.demote_all("done")
    assert reserve.live == 0
