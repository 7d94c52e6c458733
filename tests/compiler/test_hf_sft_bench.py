"""bench/hf_sft.py's inputs: the model folder it writes stands for a download (transformers
loads it whole, bf16 shards with an index), its tokenizer fits the model and renders chats
with its template, and the row's figures come from the run's metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="bench/hf_sft.py writes transformers folders")
pytest.importorskip("tokenizers", reason="bench/hf_sft.py trains a tokenizer")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hf_sft  # noqa: E402


def test_the_folder_loads_in_transformers_and_the_tokenizer_fits(tmp_path):
    import torch

    folder, rows = tmp_path / "model", tmp_path / "rows.jsonl"
    hf_sft.make_rows(rows, 50)
    n = hf_sft.make_folder("qwen2-7b", folder, smoke=True)
    hf_sft.make_tokenizer(folder, rows, vocab=200)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * n
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == n
    state = model.state_dict()
    assert all(torch.equal(state[k], torch.ones_like(state[k])) for k in state if k.endswith("norm.weight"))
    assert state["lm_head.weight"].float().std() > 0.01                # random, not zeros
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    chat = json.loads(rows.read_text().splitlines()[0])["messages"]
    ids = tok.apply_chat_template(chat, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(tok) <= model.config.vocab_size and max(ids) < len(tok)
    assert tok.decode(ids).count("<|im_start|>") == len(chat)


def test_the_row_reads_the_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    steps = [{"step": i + 1, "step_time_s": t, "tokens_per_s": 16384 / t, "tflops": 100 / t,
              "loss": 5.0 - i, "host_rss_bytes": (40 + i) << 30, "device_peak_bytes": (10 - i) << 30}
             for i, t in enumerate([90.0, 3.0, 3.4, 3.2])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    log = "loaded the weights in 3.1 s; host RSS peak so far 29.4 GiB\nplan: predicted step 2.32 s, x"
    out = hf_sft.summarize(run, log, n_params=1 << 30)
    assert out["first_step_s"] == 90.0 and out["step_s"] == 3.2 and out["steps_done"] == 4
    assert out["device_peak_bytes"] == 10 << 30 and out["host_bytes_per_param"] == 43.0
    assert out["load_s"] == 3.1 and out["predicted_step_s"] == 2.32
    assert out["load_peak_over_steady"] == pytest.approx(29.4 / 43)
