"""megatrain.train.hf_models: any transformers causal LM folder in, the same folder out.

Tiny random models built from configs (nothing downloaded), saved with transformers' own
save_pretrained, checked, loaded and saved again; logits must not move.
"""

import copy
import json
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
from _train_helpers import hf_archs, python_env
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain.train import RefusedError, hf_models

ARCHS = hf_archs(128)
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def _model(arch, attn="sdpa", seed=0, **over):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **{**ARCHS[arch], **over})
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)


@torch.no_grad()
def _logits(model):
    return model.eval()(IDS).logits


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_round_trip(tmp_path, arch, dtype):
    attn = "eager" if arch == "gemma2" else "sdpa"   # transformers has no SDPA for Gemma2
    orig = _model(arch, attn)
    ref = orig
    if dtype == "bf16":   # the files hold bf16: the reference is orig rounded to bf16
        ref = copy.deepcopy(orig)
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16).float()
        orig = copy.deepcopy(orig).to(torch.bfloat16)
    want = _logits(ref)
    src = tmp_path / "src"
    orig.save_pretrained(src)

    built = hf_models.build_meta(src)
    assert built.model.model.embed_tokens.weight.is_meta
    assert built.config.use_cache is False
    assert bool(built.notes) == (arch == "gemma2")
    assert built.config._attn_implementation == attn
    report = hf_models.check_weights(built.model, src)
    assert report.files == [src / "model.safetensors"] and report.names_checked
    assert set(report.dtypes) == {"F32" if dtype == "fp32" else "BF16"}
    assert hf_models.param_count(built.model) == sum(p.numel() for p in ref.parameters())

    model = hf_models.load_pretrained(src)
    assert model.training and model.config.use_cache is False
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    _same(_logits(model), want)

    out = tmp_path / "out"
    hf_models.save_pretrained(model, out, dtype=dtype, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1                            # sharded, with an index
    saved_cfg = json.loads((out / "config.json").read_text())
    assert saved_cfg["dtype"] == ("float32" if dtype == "fp32" else "bfloat16")
    assert saved_cfg["use_cache"] is True and model.config.use_cache is False
    assert (out / "generation_config.json").is_file()
    if arch == "qwen2":
        assert "lm_head.weight" not in index                       # tied: stored once
    if arch == "qwen3_moe":                                        # per-expert file layout
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in index
        assert not any(k.endswith("experts.gate_up_proj") for k in index)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                attn_implementation=attn)
    # bf16 files from bf16-representable weights lose nothing
    _same(_logits(back), want)
    _same(_logits(hf_models.load_pretrained(out)), want)          # and we read our shards


def test_save_with_tokenizer_files(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    src = tmp_path / "src"
    _model("llama").save_pretrained(src)
    hf_models.save_pretrained(hf_models.load_pretrained(src), tmp_path / "out",
                              tokenizer=[tok])
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "out" / "model.safetensors").is_file()      # one shard: no index


def test_model_dims(tmp_path):
    _model("qwen3_moe").save_pretrained(tmp_path)
    dims = hf_models.model_dims(hf_models.build_meta(tmp_path).config)
    assert dims == {"hidden": 32, "ffn": 64, "heads": 4, "layers": 2, "vocab_size": 128,
                    "max_seq": 64}


# ------------------------------------------------------------------------------ refusals

def _llama(tmp_path, arch="llama"):
    folder = tmp_path / "m"
    _model(arch).save_pretrained(folder)
    return folder


def _edit_weights(folder, edit):
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _refused(folder, *words):
    built = hf_models.build_meta(folder)
    with pytest.raises(RefusedError) as e:
        hf_models.check_weights(built.model, folder)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(RefusedError):             # loading refuses too: no random init
        hf_models.load_pretrained(folder)
    return str(e.value)


def test_missing_tensor(tmp_path):
    folder = _llama(tmp_path)
    _edit_weights(folder, lambda t: t.pop("model.norm.weight"))
    _refused(folder, "missing", "model.norm.weight", "model.safetensors")


def test_missing_expert(tmp_path):
    folder = _llama(tmp_path, "qwen3_moe")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    _refused(folder, "model.layers.1.mlp.experts.gate_up_proj")


def test_unexpected_tensor(tmp_path):
    folder = _llama(tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    _refused(folder, "unexpected", "model.layers.0.mlp.extra.weight", "model.safetensors")


def test_shape_mismatch(tmp_path):
    folder = _llama(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, hidden_size=48, head_dim=12)))
    _refused(folder, "shape", "config.json", "model.safetensors", "(128, 32)", "(128, 48)")


def test_int8_tensor(tmp_path):
    folder = _llama(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    _edit_weights(folder, lambda t: t.update({name: t[name].to(torch.int8)}))
    _refused(folder, name, "I8", "model.safetensors", "quantised")


def test_old_inv_freq_buffer_is_ignored(tmp_path):
    folder = _llama(tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_weights(folder, lambda t: t.update({name: torch.ones(4)}))
    report = hf_models.check_weights(hf_models.build_meta(folder).model, folder)
    assert report.ignored == [name]
    _same(_logits(hf_models.load_pretrained(folder)), _logits(_model("llama")))


def test_transformers_report_is_refused_after_loading(tmp_path, monkeypatch):
    """Even with the header check skipped, transformers' own loading report refuses."""
    folder = _llama(tmp_path)
    _edit_weights(folder, lambda t: t.pop("model.norm.weight"))
    monkeypatch.setattr(hf_models, "check_weights",
                        lambda meta, f: hf_models.WeightReport(hf_models.weight_files(f)))
    with pytest.raises(RefusedError, match=r"model\.norm\.weight"):
        hf_models.load_pretrained(folder)


def test_index_names_a_missing_shard(tmp_path):
    folder = tmp_path / "m"
    _model("llama").save_pretrained(folder, max_shard_size=40_000)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(RefusedError, match=shard.name):
        hf_models.check_weights(hf_models.build_meta(folder).model, folder)


def test_truncated_file(tmp_path):
    folder = _llama(tmp_path)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    _refused(folder, "model.safetensors", "truncated")


def test_pickle_only_folder(tmp_path):
    folder = tmp_path / "m"
    _model("llama").config.save_pretrained(folder)
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(RefusedError, match=r"pytorch_model\.bin.*convert them to safetensors"):
        hf_models.check_weights(hf_models.build_meta(folder).model, folder)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_arch",
                                                      "hidden_size": 8}))
    with pytest.raises(RefusedError, match=r"config\.json.*'no_such_arch'.*upgrade"):
        hf_models.build_meta(tmp_path)


def test_encoder_only_model(tmp_path):
    AutoConfig.for_model("distilbert").save_pretrained(tmp_path)
    with pytest.raises(RefusedError, match=r"config\.json.*'distilbert'.*not a causal"):
        hf_models.build_meta(tmp_path)


def test_quantised_config(tmp_path):
    folder = _llama(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RefusedError, match="quantised.*gptq"):
        hf_models.build_meta(folder)


def test_transformers_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers fails
    for call in (hf_models.require_transformers, lambda: hf_models.build_meta(tmp_path)):
        with pytest.raises(RefusedError, match=r'pip install "megatrain\[hf\]"'):
            call()


# ------------------------------------------------------------------------------ memory

# One process: warm up (imports, the loader's threads) on a tiny folder, reset the peak
# (clear_refs 5), load, read the peak. Growth = peak - resident before.
_RSS_CHILD = textwrap.dedent("""
    import json, sys
    from megatrain.train import hf_models
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    hf_models.load_pretrained(sys.argv[2])
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        sys.exit(f"SKIP cannot reset the peak RSS: {e}")
    before = status("VmRSS:")
    model = hf_models.load_pretrained(sys.argv[1])
    peak = status("VmHWM:")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"growth": peak - before, "params": params}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_peak_rss(tmp_path):
    """Peak RSS growth while loading bf16 shards <= 1.15 x the fp32 parameters + 16 MiB.

    In training the process holds ~12-16 bytes per parameter (fp32 weights, gradients,
    AdamW moments), so 1.15 x the 4-byte fp32 parameters alone is far stricter than 1.15 x
    the steady state. It catches a second copy of the weights: from_pretrained(folder) on
    these files peaks at ~1.55x (its memory maps keep 2 bytes/param of file pages resident).
    The 16 MiB cover the reading threads' cast buffers and allocator slack, which do not
    grow with the model.
    """
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=8000, hidden_size=512,
                               intermediate_size=1408, num_hidden_layers=4,
                               num_attention_heads=8, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(
        big, max_shard_size="12MB")
    assert len(list(big.glob("model-*.safetensors"))) >= 3
    _model("llama").to(torch.bfloat16).save_pretrained(tiny)
    run = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(big), str(tiny)],
                         env=python_env(), capture_output=True, text=True, timeout=300,
                         check=False)
    if "SKIP " in run.stderr:
        pytest.skip(run.stderr.split("SKIP ", 1)[1].strip())
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["params"] > 80e6                                    # ~21M fp32 parameters
    limit = 1.15 * got["params"] + (16 << 20)
    assert got["params"] * 0.95 < got["growth"] <= limit, got
