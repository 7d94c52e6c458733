"""The plan a bench shape gets at a budget, computed on the CPU in seconds, no GPU.

The planner sees the same graph pair on any device: this traces the bench's Llama preset
through the backend with device "cpu" and Inductor lowering (so Inductor's joint-graph
passes run), plans it as a CUDA compile would (`Options.fused_lowering`: the walk's pad for
a fused kernel's transient, and the results Inductor never writes left out; the
kept-activations chooser scores the same way), prints the plan and stops before anything
compiles or runs. Parameters are left uninitialised (their values do not enter the plan),
so a 3B model needs its 13 GB of fp32 host memory but no init time.

    python bench/plan_preview.py --model 3b --tokens 16384 --gpu-memory 12GiB
    python bench/plan_preview.py --model 1.3b --layers 8 --tokens 16384 --gpu-memory 12GiB

`--updates resident` (or auto/device/host) also gives the compile's choice of where each
region's AdamW update runs, within the reserve the plan leaves: a megatrain.AdamW owns the
parameters (its state is created at the first step, so none is allocated here). 3B/16k at
20 GiB with the fused loss: 9 of 30 regions resident, 1.0 G of 3.37 G parameters, in 18 s
and 0.6 GB of RSS (the uninitialised parameters are never touched). It also prints the
step predicted with every update on the host (what the planner chose by) and with those
sites (what `megatrain.explain(...).predicted_step_s` reports).

`--rates` plans with a GPU run's rates instead of this machine's: a train.jsonl row (its
`planned_rates`) or a Rates JSON object, inline or in a file, so a GPU row's prediction
can be reproduced, or re-made with another cost model, on the CPU:

    python bench/plan_preview.py --model 3b --tokens 16384 --gpu-memory 20GiB \
        --kernels linear_cross_entropy --updates resident --rates row.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402  (bench/hf_train.py's Hugging Face models, built from configs)
from train import _config  # noqa: E402  (the bench's presets and depth override)


class _Planned(Exception):
    """Raised by the spy once the plan exists: nothing past planning needs to run."""

    def __init__(self, schedule=None, error: Exception | None = None, sites: "UpdateSites | None" = None):
        super().__init__("planned")
        self.schedule, self.error, self.sites = schedule, error, sites


@dataclass(frozen=True)
class UpdateSites:
    """Where the compile-time choice (megatrain.compiler.update_sites) puts each region's
    AdamW update, with the parameters each region holds and the reserve it chose within."""

    sites: dict[int, str]  # region -> "host", "device" or "resident"
    numel: dict[int, int]  # region -> parameters
    reserve: int  # bytes: gpu_memory - the predicted peak - the weight path's cast staging
    pids: dict[int, tuple[int, ...]]  # region -> its parameter ids (the planner's weight ids)
    # the regions that may become resident, in the order the runtime acquires them (the end
    # of the backward first; a region with a tied weight's pieces never)
    acquiring: tuple[int, ...] = ()

    def with_resident(self, count: int) -> dict[int, str]:
        """The sites once ``count`` regions are resident (a measured step grows the set):
        the first ``count`` in acquiring order, the others where the compile put them (on
        the host if that was "resident"). The runtime skips a region that does not fit and
        takes the next, so where region sizes differ this is an approximation."""
        from megatrain.compiler.update_sites import with_live_resident

        return with_live_resident(self.sites, set(self.acquiring[:count]))

    def predicted(self, schedule, sites: dict[int, str] | None = None, updates_wait: bool = False):
        """The plan's schedule timed with these sites (or ``sites``), as explain's
        predicted step is (resident regions move nothing, device sites leave the host);
        `updates_wait`: as for an optimizer that clips (host updates after the backward)."""
        from megatrain.compiler.update_sites import timed_with_sites

        return timed_with_sites(schedule.plan.schedule, schedule.rates, self.sites if sites is None else sites,
                                self.pids, updates_wait=updates_wait)

    def summary(self) -> str:
        total = sum(self.numel.values())
        parts = []
        for site in ("resident", "device", "host"):
            regions = [r for r, s in self.sites.items() if s == site]
            if regions:
                n = sum(self.numel[r] for r in regions)
                parts.append(f"{site} {len(regions)} regions, {n / 1e9:.3f} G params ({n / total:.0%})")
        return f"reserve {self.reserve / 2**30:.2f} GiB: " + "; ".join(parts)


# [kept graph regions, plan.keep.KeepChoice or None] of the last graph planned
KEPT: list = []
CHOICES: list = []  # every keep choice of the preview: a plain loss's carries the fused estimate


@contextlib.contextmanager
def _stop_after_planning(sites: bool = False, rates=None):
    """The backend's schedule_step, planning as on CUDA with Inductor, then stopping; with
    `sites`, stopping after the update sites are chosen instead (the backend's own choice,
    made once the plan exists and the backward's gradient hand-offs are known). `rates`:
    plan with these instead of this machine's (a GPU run's `planned_rates`)."""
    import megatrain.compiler.backend as backend
    from megatrain.compiler import options as options_mod
    from megatrain.compiler import keep as keep_mod
    from megatrain.compiler import fusions
    from megatrain.compiler import op_costs
    from megatrain.compiler import rates as rates_mod
    from megatrain.compiler import schedule as schedule_mod
    from megatrain.compiler import update_sites
    from megatrain.runtime import streamer as streamer_mod

    real, real_choose = backend.schedule_step, update_sites.choose_sites
    real_rates = schedule_mod.compile_rates
    real_staging = streamer_mod.Streamer.cast_staging_bytes
    planned = []

    def spy(*args, **kwargs):
        # the backend plans as on CUDA (Options.fused_lowering is patched below, so the
        # kept-activations chooser and this plan count alike): its arguments pass as they are
        try:
            schedule = real(*args, **kwargs)
        except Exception as e:  # InfeasibleBudget: its message is the answer
            raise _Planned(error=e) from None
        if not sites:
            raise _Planned(schedule)
        planned.append(schedule)
        return schedule

    def staging_as_on_cuda(self, region_numel):
        # the reserve as on CUDA, where the weight path's cast staging (none on the CPU)
        # also lives beside the plan
        return streamer_mod.cuda_cast_staging_bytes(region_numel, self.compute_dtype)

    def choose_spy(mode, regions, params, rates, **kwargs):
        chosen = real_choose(mode, regions, params, rates, **kwargs)
        if not planned:  # the kept-activations chooser scoring a candidate, before the plan
            return chosen
        numel = {g.region: sum(params[p].numel() for p in g.pids) for g in regions}
        pids = {g.region: tuple(g.pids) for g in regions}
        acquiring = tuple(g.region for g in reversed(regions))
        raise _Planned(planned[-1], sites=UpdateSites(chosen, numel, kwargs["reserve"], pids, acquiring))

    backend.schedule_step, update_sites.choose_sites = spy, choose_spy
    streamer_mod.Streamer.cast_staging_bytes = staging_as_on_cuda
    # the decisions a calibrated device gets (which regions keep their activations)
    real_calibrated, real_keep = rates_mod.CALIBRATED, keep_mod.choose
    rates_mod.CALIBRATED = (*real_calibrated, "cpu")

    def keep_spy(*args, **kwargs):
        chosen, plain, choice = real_keep(*args, **kwargs)
        KEPT[:] = [chosen.kept, choice]
        CHOICES.append(choice)
        return chosen, plain, choice

    keep_mod.choose = keep_spy
    # the fused loss may be weighed against the plain one, as on CUDA, where its kernel runs
    real_runs_on, fusions.kernels_run_on = fusions.kernels_run_on, lambda device: True
    # the planner counts working sets as for Inductor's GPU kernels (the walk's pad for a
    # fused kernel, and what Inductor never writes left out), in the chooser's scoring too
    real_fused = options_mod.Options.fused_lowering
    options_mod.Options.fused_lowering = property(lambda self: self.lowering == "inductor")
    # and as for Triton's kernels, which recompute a shared transcendental in each reader
    real_heavy, op_costs._HEAVY_ON_CPU = op_costs._HEAVY_ON_CPU, ()
    if rates is not None:
        schedule_mod.compile_rates = lambda device: rates
    try:
        yield
    finally:
        backend.schedule_step, update_sites.choose_sites = real, real_choose
        streamer_mod.Streamer.cast_staging_bytes = real_staging
        schedule_mod.compile_rates = real_rates
        rates_mod.CALIBRATED, keep_mod.choose = real_calibrated, real_keep
        options_mod.Options.fused_lowering = real_fused
        op_costs._HEAVY_ON_CPU = real_heavy
        fusions.kernels_run_on = real_runs_on


def preview(model: str, layers: int | None, tokens: int, seq: int, gpu_memory: str,
            keep_weights: bool = False, kernels: str | None = None, updates: str | None = None,
            rates=None, host_memory: str | None = None, token_chunks: bool = False,
            outputs: str | None = None):
    """(StepSchedule, None, UpdateSites or None), or (None, the planner's error, None).
    With `updates`, a megatrain.AdamW owns the parameters (update sites are chosen only for
    the gradients handed to it), and the preview stops once the backend chose them.
    `host_memory`: the host budget of the machine planned for (the keep chooser refuses
    mixes whose offloads it cannot hold); None: unbounded, not this machine's RAM.
    `token_chunks`: the MLPs run a chunk of the sequence at a time (what the backend falls
    back to after the fused loss; the preview stops at the first plan, so it is forced).
    `outputs`: the consent option; None: "loss" for a Hugging Face model (the HF bench's
    loop reads only the loss), the default "all" for the bench's own Llama (whose forward
    returns the loss alone)."""
    import megatrain
    from megatrain.compiler import options as options_mod
    from megatrain.compiler.options import parse_bytes
    from megatrain.models import Llama

    if model in hf_models.MODELS:
        net, _, _ = hf_models.build(model, device="meta", layers=layers)
        cfg = net.config
        loss_of = lambda ids: net_step(input_ids=ids, labels=ids).loss  # noqa: E731
    else:
        cfg = _config(model, layers)
        with torch.device("meta"):
            net = Llama(cfg)
        loss_of = lambda ids: net_step(ids, labels=ids)  # noqa: E731
    net = net.to_empty(device="cpu")  # new parameters: a meta tensor has no storage to keep
    if model in hf_models.MODELS:
        net.tie_weights()  # so tied ones are one parameter again, as from_config made them
    for b in net.buffers():
        b.zero_()
    # the parameters' owner (its registry entry lives as long as it does)
    owner = megatrain.AdamW(net.parameters()) if updates else None
    # a Hugging Face model as bench/hf_systems.py compiles it: the loop reads only the loss
    # (the consent option), so its logits are neither made nor copied back
    outputs = outputs or ("loss" if model in hf_models.MODELS else "all")
    net_step = torch.compile(net, backend="megatrain",
                             options={"device": "cpu", "precision": "bf16", "gpu_memory": gpu_memory,
                                      "outputs": outputs})
    # probe_rates off: this machine's kernels say nothing of the GPU the plan is for (a
    # GPU row's own kernel rates are not recorded, so its products go at its matmul rate);
    # decision_cache off: the chooser scores with the rates given here, which its key
    # (the machine's rate files) does not see
    forced = {"lowering": "inductor", "keep_weights": keep_weights, "probe_rates": False,
              "decision_cache": False,
              "token_chunks": token_chunks,
              **({"kernels": kernels.split(",")} if kernels else {}), **({"updates": updates} if updates else {})}
    ids = torch.randint(0, cfg.vocab_size, (tokens // seq, seq))
    budget = None if host_memory is None else parse_bytes(host_memory, "host_memory")
    real_host_memory = options_mod._host_memory
    options_mod._host_memory = lambda value: budget
    with _stop_after_planning(sites=bool(updates), rates=rates), megatrain.config.patch(**forced):
        try:
            loss_of(ids)
        except Exception as e:
            found = e
            while found is not None and not isinstance(found, _Planned):
                found = found.__cause__ or found.__context__
            if found is None:
                raise
            del owner  # held until the backend chose the sites
            return found.schedule, found.error, found.sites
        finally:
            options_mod._host_memory = real_host_memory
    raise AssertionError("the backend compiled without planning")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3b", choices=["1.3b", "3b", "8b", "tiny", *hf_models.MODELS],
                   help="a bench preset, or a Hugging Face model of bench/hf_train.py")
    p.add_argument("--layers", type=int, default=None, help="depth at the preset's width")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gpu-memory", default="12GiB")
    p.add_argument("--keep-weights", action="store_true")
    p.add_argument("--kernels", default=None,
                   help="megatrain kernels swapped in, e.g. linear_cross_entropy (the fused loss "
                        "the CUDA backend falls back to when the plan does not fit)")
    p.add_argument("--updates", default=None, choices=["auto", "host", "device", "resident"],
                   help="also choose where each region's megatrain.AdamW update runs, as the "
                        "compile does (resident: the regions whose state the reserve holds)")
    p.add_argument("--rates", default=None,
                   help="plan with these rates instead of this machine's: a JSON object of "
                        "megatrain.plan.costs.Rates, or a bench/results/train.jsonl row "
                        "(its planned_rates), inline or in a file")
    p.add_argument("--host-memory", default=None,
                   help="the host budget of the machine planned for, e.g. 78GiB (default: unbounded)")
    p.add_argument("--token-chunks", action="store_true",
                   help="the MLPs run a chunk of the sequence at a time (the backend's fallback "
                        "after the fused loss)")
    p.add_argument("--outputs", default=None, choices=("loss", "all"),
                   help="the consent option (default: loss for a Hugging Face model, as the HF bench)")
    args = p.parse_args(argv)
    schedule, error, sites = preview(args.model, args.layers, args.tokens, args.seq, args.gpu_memory,
                                     args.keep_weights, args.kernels, args.updates, _rates(args.rates),
                                     args.host_memory, args.token_chunks, args.outputs)
    if error is not None:
        print(f"no plan: {error}")
        if not args.kernels:
            print("(on CUDA the backend then plans again with the fused linear-cross-entropy loss: "
                  "preview that with --kernels linear_cross_entropy)")
        elif not args.token_chunks:
            print("(the backend then plans again with token chunks: preview that with --token-chunks)")
        return 1
    plan = schedule.plan
    print(f"{args.model} layers={args.layers or 'preset'} tokens={args.tokens} gpu_memory={args.gpu_memory}: "
          f"predicted peak {plan.peak_bytes / 2**30:.3f} GiB, {plan.config}")
    print(f"  at the peak: {peak_contents(plan)}")
    if KEPT:
        kept, choice = KEPT
        scored = ", ".join(f"{n}: {'-' if s is None else f'{s:.3f}'}" for n, s in choice.scored) if choice else "forced"
        print(f"  {len(kept)} regions keep their matmul outputs (no recompute); kept count -> "
              f"predicted step s: {scored}")
    weighed = next((c for c in CHOICES if c is not None and c.fused_loss_step_s is not None), None)
    if weighed is not None:
        print(f"  the plain loss: predicted {weighed.step_s:.3f} s; the fused loss estimated at "
              f"{weighed.fused_loss_step_s:.3f} s ({'compiled instead' if len(CHOICES) > 1 else 'kept plain'})")
    print(f"  predicted step {plan.step_time:.3f} s with every update on the host "
          f"(rates: {schedule.rates.device})")
    if sites is not None:
        print(f"  updates={args.updates!r} at compile time: {sites.summary()} (a resident step later "
              "grows the reserve from the measured peak)")
        print(f"  predicted step {sites.predicted(schedule).step_time:.3f} s with those sites; "
              f"{sites.predicted(schedule, updates_wait=True).step_time:.3f} s with them and an "
              f"optimizer that clips (its host updates wait for the backward's last gradient)")
    return 0


def _rates(arg: str | None):
    """Rates from --rates: inline JSON or a file, a Rates object or a row holding one."""
    import json

    from megatrain.plan.costs import Rates

    if arg is None:
        return None
    text = Path(arg).read_text() if not arg.lstrip().startswith("{") else arg
    data = json.loads(text)
    return Rates.from_json(data.get("planned_rates") or data)


def peak_contents(plan) -> str:
    """What the planner counts live where its schedule peaks, largest first: what a leaner
    plan would have to shrink (the same words as a refused budget's error)."""
    from megatrain.plan.problem import _Shape
    from megatrain.plan.program import describe_live, live_at

    at = plan.schedule.peak_at
    if at is None:
        return "-"
    at = at._replace(step=0)  # live_at walks one step
    phase = "forward" if at.phase == "fw" else "backward"
    live = live_at(_Shape(plan.schedule.problem), plan.config, at)
    return f"{phase} of region {at.region}: {describe_live(live)}"


if __name__ == "__main__":
    raise SystemExit(main())
