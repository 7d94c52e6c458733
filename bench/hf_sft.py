"""Fine-tune a Hugging Face model folder with `megatrain train` on chat SFT rows, as a user
who downloaded a checkpoint would, and record one row: the memory plan the CLI printed,
tokens/s, model TFLOP/s, peak GPU memory, host bytes per parameter, the load time and its
host RSS peak against the run's steady state, the first step's time, and FSDP2 CPU offload's
fit on the same machine.

    python bench/hf_sft.py --model qwen2-7b --work /tmp/sft --steps 24 --out rows.jsonl

Nothing is downloaded (the GPU machines have no network), so the script first makes what a
download would have given, under --work: the model folder at a bench shape
(bench/hf_models.py), random init saved as bf16 safetensors shards with an index; a byte-level
BPE tokenizer with a ChatML template, trained on the rows; and the rows themselves
(`messages`, arithmetic questions and worked answers of varied length, so packing matters).
Then it runs the CLI with defaults: only the model, data, schedule, device and `--no-save`
(a 7B checkpoint with its AdamW moments is ~90 GB, more than the machines' disks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fit_check
import hf_models
from host_memory import _mem_available

SHARD_BYTES = 4 << 30
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_folder(name: str, folder: Path, smoke: bool) -> int:
    """The model's config and bf16 shards with an index; returns the parameter count.
    Each tensor is cut from one pool of normal(0, 0.02) values (norm weights ones, biases
    zeros): random enough for a throughput run, and ~10x faster than drawing 7G values."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model, _, _ = hf_models.build(name, smoke, device="meta")
    tensors, seen = [], set()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:        # a tied weight is saved once, under its first name
            continue
        seen.add(id(t))
        tensors.append((key, tuple(t.shape)))
    biggest = max(int(torch.Size(s).numel()) for _, s in tensors)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(biggest + 4096, generator=gen) * 0.02).to(torch.bfloat16)
    weight_map, shard, shard_bytes, names = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            fname = f"part-{len(names):05d}.safetensors"
            save_file(shard, folder / fname, metadata={"format": "pt"})
            names.append(fname)
            weight_map.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    n_params = 0
    for key, shape in tensors:
        n = int(torch.Size(shape).numel())
        n_params += n
        if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        elif key.endswith(".bias"):
            t = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            off = random.Random(key).randrange(4096)
            t = pool[off:off + n].clone().view(shape)
        if shard_bytes + 2 * n > SHARD_BYTES:
            flush()
        shard[key] = t
        shard_bytes += 2 * n
    flush()
    # the transformers naming, once the count is known: model-0000i-of-0000N.safetensors
    final = {f: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, f in enumerate(names)}
    for f, name in final.items():
        (folder / f).rename(folder / name)
    weight_map = {k: final[v] for k, v in weight_map.items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * n_params}, "weight_map": weight_map}, indent=1))
    cfg = model.config
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)
    return n_params


def make_rows(path: Path, n: int, seed: int = 0) -> None:
    """Chat rows: a system line, a question, a worked answer of 1-40 lines."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            a, b = rng.randrange(10, 10_000), rng.randrange(10, 10_000)
            steps = [f"Step {i + 1}: {a} + {i} * {b} = {a + i * b}." for i in range(rng.randint(1, 40))]
            fh.write(json.dumps({"messages": [
                {"role": "system", "content": "You are a careful math tutor."},
                {"role": "user", "content": f"What is {a} + k * {b} for k = 0.. {len(steps) - 1}?"},
                {"role": "assistant", "content": " ".join(steps)}]}) + "\n")


def make_tokenizer(folder: Path, rows: Path, vocab: int) -> None:
    """A byte-level BPE with the ChatML template, saved into the model folder (where the CLI
    looks first, as for a downloaded model). Its alphabet is the rows' characters only, so
    it fits the smoke models' 256-token vocabulary too."""
    import tokenizers
    import transformers

    # the rendered text (roles and newlines too): every character is in the alphabet
    texts = [f"{m['role']}\n{m['content']}\n" for line in rows.open()
             for m in json.loads(line)["messages"]]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts[:20_000], tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, show_progress=False, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)


def summarize(run: Path, log: str, n_params: int) -> dict:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    steps = [r for r in rows if "step_time_s" in r]
    steady = steps[1:]
    out = {"steps_done": len(steps)}
    if steps:
        out["first_step_s"] = steps[0]["step_time_s"]
        out["losses"] = [round(r["loss"], 4) for r in steps]
    if steady:
        med = statistics.median(r["step_time_s"] for r in steady)
        out.update(step_s=med, step_s_range=[min(r["step_time_s"] for r in steady),
                                             max(r["step_time_s"] for r in steady)],
                   tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                   tflops=statistics.median(r["tflops"] for r in steady),
                   host_rss_bytes=steady[-1]["host_rss_bytes"],
                   host_bytes_per_param=steady[-1]["host_rss_bytes"] / n_params)
    peaks = [r["device_peak_bytes"] for r in steps if r.get("device_peak_bytes")]
    if peaks:
        out["device_peak_bytes"] = max(peaks)
    if steps and steps[-1].get("device_alloc_retries") is not None:
        out["device_alloc_retries"] = steps[-1]["device_alloc_retries"]   # over the run
    m = re.search(r"loaded the weights in ([\d.]+) s; host RSS peak so far ([\d.]+) (\w+)", log)
    if m:
        unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[m.group(3)]
        out["load_s"], out["load_peak_rss_bytes"] = float(m.group(1)), float(m.group(2)) * unit
        if out.get("host_rss_bytes"):
            out["load_peak_over_steady"] = out["load_peak_rss_bytes"] / out["host_rss_bytes"]
    m = re.search(r"plan: predicted step ([\d.]+) (m?s)", log)
    if m:
        out["predicted_step_s"] = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    # the last line's prediction: with the update sites the run ended with (the resident
    # set grows after measured steps), and how many parameters' AdamW state was on the GPU
    m = re.search(r"^done: .*\(plan: ([\d.]+) (m?s)", log, re.MULTILINE)
    if m:
        out["predicted_step_s_after_step1"] = out.get("predicted_step_s")
        out["predicted_step_s"] = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    m = re.search(r"AdamW state of ([\d,]+) M params", log)
    out["resident_params"] = float(m.group(1).replace(",", "")) * 1e6 if m else 0
    plan = [ln for ln in log.splitlines() if ln.startswith(("  ", "memory plan", "host", "GPU"))]
    out["memory_plan"] = "\n".join(plan[:40])
    return out


def _gpu_name() -> str | None:
    """The card's name from nvidia-smi: asking torch would open a CUDA context in this
    process, which holds device memory while the run beside it measures its own."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-7b", choices=sorted(hf_models.MODELS))
    p.add_argument("--work", default="/tmp/megatrain-sft")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--timeout", type=float, default=480)
    p.add_argument("--smoke", action="store_true", help="a scaled-down model on the CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="hf_sft.jsonl")
    args = p.parse_args()
    work = Path(args.work)
    folder, rows, run = work / args.model, work / "rows.jsonl", work / "run"
    row = {"bench": "hf_sft", "model": args.model, "family": hf_models.family(args.model),
           "seq": args.seq, "batch_tokens": args.batch_tokens, "steps": args.steps,
           "commit": os.environ.get("MEGATRAIN_COMMIT"), "smoke": args.smoke}
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    make_rows(rows, args.rows)
    n_params = make_folder(args.model, folder, args.smoke)
    make_tokenizer(folder, rows, vocab=2000 if not args.smoke else 200)
    row.update(params=n_params, make_folder_s=time.perf_counter() - t0,
               host_mem_available_bytes=_mem_available())
    print(f"made {folder} ({n_params / 1e9:.2f} G params, bf16) in {row['make_folder_s']:.0f} s",
          flush=True)
    try:
        fit_check._refuse_if_unfit("fsdp2-offload", n_params, None)
        row["fsdp2_offload"] = "fits the host's fit check (not run here)"
    except SystemExit as e:
        row["fsdp2_offload"] = f"refused: {e}"
    cmd = [sys.executable, "-m", "megatrain", "train", "--model", str(folder), "--data", str(rows),
           "--seq", str(args.seq), "--batch-tokens", str(args.batch_tokens), "--steps",
           str(args.steps), "--no-save", "--no-progress", "--out", str(run), "--overwrite"]
    if args.device:
        cmd += ["--device", args.device]
    row["command"] = " ".join(["megatrain", *cmd[3:]])
    t1 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        log, row["rc"] = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:   # its output comes as bytes even with text=True
        log = "".join(x.decode() if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        row["rc"] = "timeout"
    row["wall_s"] = time.perf_counter() - t1
    row["gpu"] = _gpu_name()
    (work / "train.log").write_text(log)
    row.update(summarize(run, log, n_params))
    if row["rc"] != 0:
        row["log_tail"] = log[-3000:]
    with open(args.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(log[-4000:])
    keys = ("model", "params", "rc", "steps_done", "step_s", "tokens_per_s", "tflops",
            "device_peak_bytes", "host_bytes_per_param", "load_s", "load_peak_over_steady",
            "first_step_s", "predicted_step_s", "resident_params", "fsdp2_offload")
    print(json.dumps({k: row.get(k) for k in keys}, indent=1))


if __name__ == "__main__":
    main()
