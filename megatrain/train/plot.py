"""`megatrain plot DIR`: loss (with the eval loss, if any) and throughput from
DIR/metrics.jsonl as DIR/metrics.png."""

from __future__ import annotations

from pathlib import Path

from . import RefusedError
from .metrics import read_metrics

FILENAME = "metrics.png"


def _smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    """Bias-corrected exponential moving average (no lag towards the first value)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = (1 - alpha) * acc + alpha * v
        out.append(acc / (1 - (1 - alpha) ** i))
    return out


def plot_metrics(out: str | Path, path: str | Path | None = None) -> Path:
    """Write a PNG (Agg, no display needed) and return its path."""
    rows = read_metrics(out)
    if not rows:
        raise RefusedError(f"{out}: no metrics.jsonl rows to plot; pass the --out folder of a "
                           f"training run")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    rows = [r for r in rows if "loss" in r]     # a step's row (eval rows hold eval_loss)
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    tps = [r.get("tokens_per_s") or 0.0 for r in rows]
    tflops = [r.get("tflops") or 0.0 for r in rows]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label="loss")
    ax1.plot(steps, _smooth(loss), color="tab:blue", linewidth=2, label="loss (EMA)")
    if evals:
        ax1.plot(*zip(*evals), color="tab:orange", marker="o", linewidth=1.5, label="eval loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_title("training loss")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(steps, tps, color="tab:green", linewidth=1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax2.set_title("throughput")
    ax2.grid(alpha=0.3)
    ratios = [f / t for f, t in zip(tflops, tps) if t and f]
    if ratios:   # TFLOP/s is tokens/s times a constant: show it as a second scale
        k = ratios[-1]
        sec = ax2.secondary_yaxis("right", functions=(lambda x: x * k, lambda y: y / k))
        sec.set_ylabel("model TFLOP/s")
    fig.tight_layout()
    target = Path(path) if path is not None else Path(out) / FILENAME
    fig.savefig(target)
    return target
