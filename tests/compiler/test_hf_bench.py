"""bench/hf_train.py, the bench of models nobody adapted, on the CPU: its --smoke path builds
Hugging Face models from configs, trains them through megatrain in child processes and
writes bench/train.py's rows with the model's family, which bench/readme_table.py renders.

The parent runs in this process and each system in a child, as on a GPU. One dense model
runs with megatrain's defaults; the mixture of experts runs as a variant
(megatrain+lowering=eager), which also covers the variant syntax and keeps the test
within a minute on two cores (a cold Inductor cache compiles C++ for every graph).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="bench/hf_train.py builds transformers models; "
                    "transformers is in the test extra")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import hf_models
import hf_train
import readme_table

REQUIRED = ("system", "model", "family", "layers", "params", "tokens_per_step", "seq", "step_s",
            "tokens_per_s", "tflops", "peak_gpu_gib", "host_rss_gib", "host_bytes_per_param",
            "gpu_memory", "losses", "final_loss", "predicted_step_s", "first_step_s", "run_id",
            "commit", "gpu", "torch", "time", "hostname")


@pytest.mark.slow  # bench tooling: every scaled-down model through bench/hf_train.py --smoke
def test_smoke_rows_carry_the_family_and_render(tmp_path):
    out = tmp_path / "train.jsonl"
    assert hf_train.main(["--smoke", "--model", "llama-1.3b", "--out", str(out)]) == 0
    assert hf_train.main(["--smoke", "--model", "qwen3-moe-0.7b", "--systems", "megatrain+lowering=eager",
                          "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model"], r["family"]) for r in rows] == [("llama-1.3b", "llama"), ("qwen3-moe-0.7b", "qwen3_moe")]
    for r in rows:
        assert "error" not in r, r.get("error")
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["system"] == "megatrain" and r["gpu"] == "cpu" and r["seq"] == 64
        assert r["layers"] == 2 and r["params"] == hf_models.param_count(r["model"], smoke=True)
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["predicted_step_s"] > 0
        assert r["first_step_s"] >= r["steps"][0] > 0
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])
        assert r["losses"][-1] < r["losses"][0] + 0.1, r["losses"]  # trains, does not diverge
        assert r["dynamo_graphs"] == 1 and r["attn_implementation"] == "sdpa"
        assert all(w["s"] >= 0 and w["reason"] in ("host", "h2d", "d2h", "other")
                   for w in r["predicted_waits"]), r["predicted_waits"]
    dense, moe = rows
    assert dense["updates"] is None and dense["prefetch"] is None and dense.get("forced") is None
    assert moe["variant"] == "megatrain+lowering=eager" and moe["forced"] == {"lowering": "eager"}
    assert moe["experts_implementation"] is not None

    table = readme_table.performance_table(readme_table.load(out, gpu="cpu"), variants=True)
    assert "| family |" in table.splitlines()[0]
    assert "| llama-1.3b (2 layers) | llama |" in table and "| qwen3_moe |" in table, table
    # the README's table: megatrain's defaults only, a forced variant left out
    table = readme_table.performance_table(readme_table.load(out, gpu="cpu"))
    assert "| llama |" in table and "qwen3_moe" not in table, table


def test_megatrain_without_a_budget_is_refused_before_any_child():
    with pytest.raises(SystemExit, match="--gpu-memory"):
        hf_train.main(["--model", "llama-1.3b", "--systems", "megatrain,resident-compiled"])


def test_flops_count_the_routed_share_of_the_experts():
    """6 x the matmul parameters a token goes through: of an expert stack, top-k / experts."""
    from torch import nn

    model, _, _ = hf_models.build("qwen3-moe-0.7b", smoke=True, device="meta")
    cfg = model.config
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    attention = 12 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * 64 * cfg.num_hidden_layers
    want = 6 * (linears + experts * cfg.num_experts_per_tok / cfg.num_experts) + attention
    assert experts > 0 and hf_models.flops_per_token(model, 64) == pytest.approx(want)
