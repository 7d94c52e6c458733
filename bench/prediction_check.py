"""The cost model against every recorded GPU step, on the CPU: each megatrain row of
bench/results/train.jsonl is planned again (bench/plan_preview.py) with the rates that run
planned with (`planned_rates`), and its predicted step is printed beside the measured one:
with every update on the host (what the planner chooses by) and with the row's update
sites (what `megatrain.explain(...).predicted_step_s` reports). Run it before and after a
cost-model change to see what the change does to every prediction, before any GPU time.

    python bench/prediction_check.py                    # every row (~15 s a shape)
    python bench/prediction_check.py --model 3b --since 2026-12-05

A row's live resident set (`updates="resident"`, grown after measured steps) is taken as
its recorded count of regions, the first in the runtime's acquiring order; the runtime
skips a region that does not fit and takes the next, so where sizes differ this is an
approximation. What the planner does not model shows as error: the backlog's reordering,
the weight shadow's 2-byte fetches, the gradient ring. 8B rows are left out unless asked
for: tracing needs the model's 32 GB of (untouched) fp32 parameters in virtual memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_preview import preview  # noqa: E402

ROWS = Path(__file__).resolve().parent / "results" / "train.jsonl"
# Device memory bandwidth (a bf16 copy, read + write) for rows planned before the probe
# measured it: assumed from the card's specification (about 80% of HBM peak), flagged in
# the output; a row that recorded it is planned with its own.
ASSUMED_MEMORY = {"H100": 2.7e12, "H200": 3.9e12}


def row_rates(row: dict):
    """The rates a row planned with, the device memory rate assumed where it predates it."""
    from megatrain.plan.costs import Rates

    data = dict(row["planned_rates"])
    if data.get("memory") is None:
        kind = next((k for k in ASSUMED_MEMORY if k in str(row.get("gpu", ""))), None)
        data["memory"] = ASSUMED_MEMORY[kind] if kind else None
    return Rates.from_json(data)


def rows_to_check(path: Path, models: list[str] | None = None, since: str | None = None) -> list[dict]:
    """The megatrain rows that recorded the rates they planned with (and ran)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("system") != "megatrain" or not r.get("planned_rates") or r.get("error") or not r.get("step_s"):
            continue
        if (models and r["model"] not in models) or (not models and r["model"] == "8b"):
            continue
        if since and str(r.get("time", "")) < since:
            continue
        out.append(r)
    return out


def replan(row: dict, cache: dict) -> dict:
    """The row's plan again, with its rates: predicted step with every update on the host,
    and with its update sites (live resident count applied); None where no plan fits."""
    rates = row_rates(row)
    kernels = row.get("kernels") or None  # "a,b" in the rows (a list in older ones)
    kernels = ",".join(kernels) if isinstance(kernels, list) else kernels
    updates = row.get("updates") if row.get("updates") in ("auto", "device", "resident") else None
    if updates is None and row.get("resident_regions"):  # the planner's default chose them
        updates = "resident"
    key = (row["model"], row.get("layers"), row["tokens_per_step"], row.get("seq", 2048), row["gpu_memory"],
           kernels, bool(row.get("keep_weights")), updates, repr(rates))
    if key not in cache:
        args = (row["model"], row.get("layers"), row["tokens_per_step"], row.get("seq", 2048), row["gpu_memory"])
        schedule, error, sites = preview(*args, bool(row.get("keep_weights")), kernels, updates, rates)
        if error is not None and kernels is None:  # on CUDA the backend plans again with the fused loss
            schedule, error, sites = preview(*args, bool(row.get("keep_weights")), "linear_cross_entropy",
                                             updates, rates)
        cache[key] = (schedule, error, sites)
    schedule, error, sites = cache[key]
    if error is not None:
        return {"error": str(error).splitlines()[0][:120]}
    sited = schedule.plan.schedule
    if sites is not None:
        live = row.get("resident_regions")
        chosen = sites.with_resident(live) if updates == "resident" and live is not None else sites.sites
        sited = sites.predicted(schedule, chosen)
    return {"host": schedule.plan.step_time, "sited": sited.step_time,
            "streams": {s: sum(sited.end[t] - sited.start[t] for t in sited.streams[s]) / sited.steps
                        for s in ("compute", "h2d", "d2h", "host")}}


def _pct(pred: float | None, measured: float) -> str:
    return "-" if pred is None else f"{pred:.3f} ({(pred / measured - 1) * 100:+.0f}%)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=Path, default=ROWS)
    p.add_argument("--model", action="append", help="only these models (repeat); 8b only when named")
    p.add_argument("--since", default=None, help="rows whose time is at or after this (ISO date or time)")
    args = p.parse_args(argv)
    rows = rows_to_check(args.rows, args.model, args.since)
    print(f"{len(rows)} rows")
    print("| row | measured s | recorded | all host now | with its sites now | compute / host busy, predicted -> measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    errors = {"recorded": [], "host": [], "sited": []}
    cache: dict = {}
    for r in rows:
        got = replan(r, cache)
        name = (f"{r.get('commit')} {str(r.get('gpu', ''))[:12].strip()}: {r['model']} L{r.get('layers')} "
                f"{r['tokens_per_step'] // 1024}k {r['gpu_memory']} {r.get('variant') or r.get('updates')}")
        measured = r["step_s"]
        if "error" in got:
            print(f"| {name} | {measured:.3f} | {_pct(r.get('predicted_step_s'), measured)} | {got['error']} | | |")
            continue
        s = got["streams"]
        busy = (f"{s['compute']:.3f} -> {r.get('measured_compute_s') or 0:.3f} / "
                f"{s['host']:.3f} -> {r.get('host_busy_s') or 0:.3f}")
        print(f"| {name} | {measured:.3f} | {_pct(r.get('predicted_step_s'), measured)} | "
              f"{_pct(got['host'], measured)} | {_pct(got['sited'], measured)} | {busy} |")
        for k, v in (("recorded", r.get("predicted_step_s")), ("host", got["host"]), ("sited", got["sited"])):
            if v:
                errors[k].append(abs(v / measured - 1))
    for k, errs in errors.items():
        if errs:
            print(f"mean absolute error, {k}: {statistics.mean(errs) * 100:.0f}% over {len(errs)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
