"""Markdown tables from bench/results/train.jsonl, so the README's Performance section is
regenerated from recorded rows instead of edited by hand.

    python bench/readme_table.py                  # the README's table: megatrain's defaults
    python bench/readme_table.py --variants       # forced configurations too (diagnostics)
    python bench/readme_table.py --gpu H200 --model 1.3b
    python bench/readme_table.py --depth --model 1.3b --tokens 16384   # the depth sweep

The README shows what a user gets: the latest megatrain row per (model, layers,
tokens/step, gpu_memory) run with no decision forced (no variant, `updates` and `prefetch`
recorded as left to the planner), and the latest baseline rows (resident compiled, FSDP2,
ZeRO-3) of the same model, tokens and commit. Forced configurations are diagnostics: `--variants` lists them.

"vs resident-compiled" divides by a resident-compiled row of the same run (same `run_id`;
rows from before run_id existed: same commit and start `time`), or of the same commit on
the same machine (`hostname`) within half an hour: steps from different machines or
commits differ by more than the effects measured. A system that failed shows "failed" with
its error as a note under the table. Rows run on the CPU (--smoke) are left out unless
--gpu names "cpu".
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO)]

from hf_models import MODELS as HF_MODELS  # noqa: E402  (bench/hf_train.py's models)
from hf_models import layers as hf_layers  # noqa: E402
from train import MODELS, SYSTEMS  # noqa: E402  (train imports torch lazily)

GIB = 2**30


def load(path: str | Path, gpu: str | None = None, keep_cpu: bool = False) -> list[dict]:
    """Rows of the jsonl file in file order, each with its line number as `_line`."""
    rows = [dict(json.loads(line), _line=i) for i, line in enumerate(Path(path).read_text().splitlines())
            if line.strip()]
    if gpu:
        return [r for r in rows if gpu.lower() in str(r.get("gpu", "")).lower()]
    return rows if keep_cpu else [r for r in rows if r.get("gpu") != "cpu"]


def run_key(row: dict):
    return row.get("run_id") or (row.get("commit"), row.get("time"))


def preset_layers(model: str) -> int:
    if model in HF_MODELS:  # a Hugging Face model of bench/hf_train.py
        return hf_layers(model)
    from megatrain.models import PRESETS

    return PRESETS[MODELS[model]].layers


def layers(row: dict) -> int:
    """Rows from before --layers existed ran the preset's depth."""
    return row.get("layers") or preset_layers(row["model"])


def label(row: dict) -> str:
    """The system with its variant's flags (megatrain+updates=auto): variants of one system
    are different rows, never each other's latest."""
    return row.get("variant") or row["system"]


def budget(row: dict) -> str | None:
    """megatrain's gpu_memory: rows at different budgets are different rows."""
    return row.get("gpu_memory") if row["system"] == "megatrain" else None


def forced(row: dict) -> bool:
    """Whether the row forced one of megatrain's decisions (a variant, a decision flag such
    as --keep-activations, or the bench's old defaults, which forced updates="host" and
    prefetch=1)."""
    # Rows from before the decisions were recorded count as forced: what ran is unknown.
    return row["system"] == "megatrain" and (
        label(row) != row["system"] or row.get("updates", "?") is not None
        or row.get("prefetch", "?") is not None
        or any(row.get(k) is not None for k in ("kernels", "backlog", "grad_chunk", "keep_activations"))
        or row.get("offload") is False or bool(row.get("keep_weights")) or bool(row.get("weight_shadow")))


def _minutes(row: dict) -> float | None:
    try:
        return datetime.strptime(row["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp() / 60
    except (KeyError, ValueError):
        return None


def compiled_step(row: dict, compiled_rows: list[dict]) -> float | None:
    """The step of the resident-compiled row `row` may be compared with (module docstring)."""
    same = (row["model"], layers(row), row.get("tokens_per_step"))
    for c in compiled_rows:
        if (c["model"], layers(c), c.get("tokens_per_step")) != same:
            continue
        if run_key(c) == run_key(row):
            return c["step_s"]
    t = _minutes(row)
    for c in compiled_rows:
        tc = _minutes(c)
        if ((c["model"], layers(c), c.get("tokens_per_step")) == same and row.get("hostname")
                and c.get("hostname") == row.get("hostname") and c.get("commit") == row.get("commit")
                and t is not None and tc is not None and abs(t - tc) <= 30):
            return c["step_s"]
    return None


def latest(rows: list[dict], key) -> dict:
    """The newest row per key(row): by start time, then by position in the file."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: (r.get("time", ""), r["_line"])):
        out[key(r)] = r
    return out


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def performance_table(rows: list[dict], model: str | None = None, variants: bool = False,
                      family: str | None = None) -> str:
    """The README table (module docstring); with `variants`, the latest row of every
    system or variant too. Rows of bench/hf_train.py carry the model's `family` (llama,
    qwen2, ...): where any shown row has one, a family column follows the model's;
    `family` keeps that family's rows only."""
    if model:
        rows = [r for r in rows if r.get("model") == model]
    if family:
        rows = [r for r in rows if r.get("family") == family]
    compiled_rows = [r for r in rows if r["system"] == "resident-compiled" and "step_s" in r]
    if not variants:
        rows = [r for r in rows if not forced(r)]
        # baselines beside them: of a commit a default megatrain row of that shape ran at
        shown = {(r["model"], layers(r), r.get("tokens_per_step"), r.get("commit"))
                 for r in rows if r["system"] == "megatrain"}
        rows = [r for r in rows if (r["model"], layers(r), r.get("tokens_per_step"), r.get("commit")) in shown]
    chosen = latest(rows, lambda r: (r["model"], layers(r), r.get("tokens_per_step"), label(r), budget(r)))
    rank = lambda name, names: names.index(name) if name in names else len(names)  # noqa: E731
    order = sorted(chosen.values(), key=lambda r: (rank(r["model"], list(MODELS) + list(HF_MODELS)), layers(r),
                                                   r.get("tokens_per_step") or 0, rank(r["system"], SYSTEMS),
                                                   label(r), budget(r) or ""))
    families = any(r.get("family") for r in order)
    out = ["| system | model " + ("| family " if families else "") + "| tokens/step | tok/s | TFLOP/s | MFU "
           "| vs resident-compiled | peak GPU GiB | host RSS GiB | GPU |", "| --- " * (11 if families else 10) + "|"]
    notes, runs = [], {}
    for r in order:
        system = label(r) + (f" ({budget(r)})" if budget(r) else "")
        name = r["model"] + ("" if layers(r) == preset_layers(r["model"]) else f" ({layers(r)} layers)")
        head = f"| {system} | {name} " + (f"| {r.get('family') or '-'} " if families else "") \
            + f"| {r.get('tokens_per_step', '-')} "
        if "error" in r:
            notes.append(f"{len(notes) + 1}. {label(r)}, {name}, {r.get('tokens_per_step')} tokens "
                         f"({r.get('time', '?')}): {r['error']}")
            out.append(head + f"| failed ({len(notes)}) | - | - | - | - | - | {r.get('gpu', '-')} |")
            continue
        ref = compiled_step(r, compiled_rows)
        out.append(head + f"| {r['tokens_per_s'] / 1e3:.1f}k | {_fmt(r.get('tflops'), '.0f')} "
                   f"| {_fmt(r.get('mfu'), '.2f')} | {_fmt(ref and ref / r['step_s'], '.2f')} "
                   f"| {_fmt(r.get('peak_gpu_gib'), '.1f')} | {_fmt(r.get('host_rss_gib'), '.1f')} "
                   f"| {r.get('gpu', '-')} |")
        runs.setdefault(run_key(r), (r, []))[1].append(label(r))
    out.append("")
    out += [f"Rows of {r.get('time', '?')} (commit {str(r.get('commit', '?'))[:7]}"
            f"{', dirty tree' if r.get('dirty') else ''}): {', '.join(systems)}"
            for r, systems in runs.values()]
    if notes:
        out += ["", "Failed:"] + notes
    return "\n".join(out)


def depth_table(rows: list[dict], model: str, tokens: int | None, system: str,
                gpu_memory: str | None) -> str:
    """Issue 6's depth sweep: latest row per layer count; peak GPU memory should stay flat
    (within 10% of the shallowest run) and the time per added layer steady. The marginal
    time per layer is shown only between rows of one machine (the same GPU name): lent
    hosts differ in their host optimizer's rate, which sets the step at this width."""
    rows = [r for r in rows if label(r) == system and r.get("model") == model and "error" not in r
            and (tokens is None or r.get("tokens_per_step") == tokens)
            and (gpu_memory is None or r.get("gpu_memory") == gpu_memory)]
    chosen = sorted(latest(rows, layers).values(), key=layers)
    if not chosen:
        return f"no {system} rows for {model}" + (f" at {tokens} tokens/step" if tokens else "")
    base = chosen[0]
    out = [f"| layers | step s | s/layer | marginal s/layer | tokens/s | peak GPU GiB "
           f"| peak vs {layers(base)} layers | host B/param | GPU | time |", "| --- " * 10 + "|"]
    prev = None
    for r in chosen:
        marginal = ((r["step_s"] - prev["step_s"]) / (layers(r) - layers(prev))
                    if prev and prev.get("gpu") == r.get("gpu") else None)
        peak, peak0 = r.get("peak_gpu_gib"), base.get("peak_gpu_gib")
        out.append(f"| {layers(r)} | {r['step_s']:.3f} | {r['step_s'] / layers(r):.4f} "
                   f"| {_fmt(marginal, '.4f')} | {r['tokens_per_s']:.0f} | {_fmt(peak, '.2f')} "
                   f"| {_fmt(peak and peak0 and peak / peak0, '.3f')} "
                   f"| {_fmt(r.get('host_bytes_per_param'), '.1f')} | {r.get('gpu', '-')} | {r.get('time', '-')} |")
        prev = r
    peaks = [r["peak_gpu_gib"] for r in chosen if r.get("peak_gpu_gib")]
    if peaks:
        spread = max(peaks) / min(peaks) - 1
        out += ["", f"peak GPU spread over depths: {spread:.1%} ({'within' if spread <= 0.10 else 'over'} "
                    f"issue 6's 10%)"]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", default=str(REPO / "bench/results/train.jsonl"))
    p.add_argument("--gpu", default=None, help="only rows whose GPU name contains this")
    p.add_argument("--model", default=None)
    p.add_argument("--family", default=None, help="only rows of this model family (bench/hf_train.py's)")
    p.add_argument("--variants", action="store_true",
                   help="forced configurations and old rows too, not only megatrain's defaults")
    p.add_argument("--depth", action="store_true", help="the depth-sweep table instead")
    p.add_argument("--tokens", type=int, default=None, help="--depth: tokens per step")
    p.add_argument("--system", default="megatrain", help="--depth: which system")
    p.add_argument("--gpu-memory", default=None, help="--depth: only rows run at this budget")
    args = p.parse_args(argv)
    rows = load(args.file, args.gpu, keep_cpu=args.depth)  # --depth filters by model and tokens
    if args.depth:
        print(depth_table(rows, args.model or "1.3b", args.tokens, args.system, args.gpu_memory))
    else:
        print(performance_table(rows, args.model, args.variants, args.family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
