"""Hugging Face Llama folders: config + safetensors in, train, HF-named checkpoint out.

`--model FOLDER` builds the folder's model through transformers (any causal LM: Llama folders
too); hf.py's name mapping between Llama folders and megatrain's own Llama stays, for the
presets' checkpoints, and is tested on its own here."""

import json

import pytest
import torch
from _train_helpers import SMALL, rows, train
from safetensors.torch import load_file, save_file

from megatrain.cli import main
from megatrain.models import Llama
from megatrain.train import checkpoint, hf

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "transformers_version": "4.46.0",
}


def _hf_names(cfg) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg["tie_word_embeddings"]:
        names.append("lm_head.weight")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def _write_folder(folder, cfg, dtype=torch.float32, extra=None):
    """An HF folder written the way transformers writes one (names spelled out here)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(1)
    model = Llama(hf.llama_config_from_hf(cfg))
    sd = model.state_dict()
    tensors = {}
    for name in _hf_names(cfg):
        ours = name.removeprefix("model.")
        tensors[name] = sd[ours].to(dtype).contiguous()
    tensors.update(extra or {})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_name_mapping_is_a_bijection():
    names = _hf_names(CONFIG)
    model = Llama(hf.llama_config_from_hf(CONFIG))
    assert sorted(hf.to_hf_name(n) for n in model.state_dict()) == sorted(names)
    assert all(hf.to_hf_name(hf.from_hf_name(n)) == n for n in names)
    with pytest.raises(KeyError):
        hf.from_hf_name("model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip(tmp_path, tied):
    cfg = dict(CONFIG, tie_word_embeddings=tied)
    src = tmp_path / "hf"
    inv = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}   # old HF buffer
    start = _write_folder(src, cfg, dtype=torch.bfloat16, extra=inv)
    # loading puts the file's tensors into the model, cast to fp32
    model = Llama(hf.llama_config_from_hf(cfg))
    hf.load_weights(model, hf.weight_files(src))
    assert torch.equal(model.embed_tokens.weight, start["model.embed_tokens.weight"].float())
    if tied:
        assert model.lm_head.weight is model.embed_tokens.weight
    # train from the folder, save
    out = tmp_path / "run"
    assert train("--model", str(src), "--steps", "2", "--lr", "1e-4", "--out", str(out)) == 0
    ckpt = checkpoint.latest_checkpoint(out)
    saved = load_file(str(ckpt / "model.safetensors"))
    assert set(saved) == set(_hf_names(cfg))                       # HF names, no extras
    assert all(t.dtype == torch.float32 for t in saved.values())  # the fp32 master
    for name, t in saved.items():                                  # trained from the file's weights
        assert (t - start[name].float()).abs().max() < 5e-3, name
    out_cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
                "vocab_size", "bos_token_id", "eos_token_id"):
        assert out_cfg[key] == cfg[key], key
    # written by transformers 5: rope_theta inside rope_parameters, "dtype" for "torch_dtype"
    assert out_cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"]
    assert out_cfg["tie_word_embeddings"] is tied and out_cfg["dtype"] == "float32"
    assert out_cfg["architectures"] == ["LlamaForCausalLM"]
    # the checkpoint folder is itself a valid --model folder
    again = Llama(hf.llama_config_from_hf(out_cfg))
    hf.load_weights(again, hf.weight_files(ckpt))
    for name, t in again.state_dict().items():
        assert torch.equal(t, saved[hf.to_hf_name(name)] if hf.to_hf_name(name) in saved
                           else saved["model.embed_tokens.weight"]), name
    assert train("--model", str(ckpt), "--steps", "1", "--out", str(tmp_path / "run2")) == 0
    assert len(rows(tmp_path / "run2")) == 1


def test_sharded_save_and_load(tmp_path):
    model = Llama(hf.llama_config_from_hf(CONFIG))
    files = hf.save_weights(model, tmp_path, shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json") in files and len(files) > 3
    other = Llama(hf.llama_config_from_hf(CONFIG))
    hf.load_weights(other, hf.weight_files(tmp_path))
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), n


# transformers builds every one of these configs; each is refused because the weights (or the
# config itself) do not make that model, naming what is wrong
@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"attention_bias": True}, "missing ['model.layers.0.self_attn.k_proj.bias'"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unexpected model.embed_tokens"),
    ({"hidden_size": 96}, "shape (256, 64), but config.json makes lm_head.weight (256, 96)"),
])
def test_unsupported_or_mismatched_folders_are_refused(tmp_path, capsys, change, needle):
    src = tmp_path / "hf"
    _write_folder(src, CONFIG)
    (src / "config.json").write_text(json.dumps(dict(CONFIG, **change)))
    assert train("--model", str(src), "--steps", "1", "--out", str(tmp_path / "r")) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("config", [CONFIG, {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32,
                                              "n_layer": 2, "n_head": 2, "n_positions": 64}])
def test_folder_without_weights_starts_from_random_init(tmp_path, config):
    """Any causal LM transformers builds, Llama or not (GPT-2 was refused before folders went
    through transformers)."""
    src = tmp_path / "cfg-only"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    assert main(["train", *SMALL, "--model", str(src), "--steps", "1",
                 "--out", str(tmp_path / "r")]) == 0


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, tied):
    """The checkpoint folder of a run is a Hugging Face model folder: transformers loads it
    and computes what megatrain's model computes."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    cfg = dict(CONFIG, tie_word_embeddings=tied)
    src = tmp_path / "hf"
    _write_folder(src, cfg, dtype=torch.float32)
    out = tmp_path / "run"
    assert train("--model", str(src), "--steps", "2", "--lr", "1e-3", "--out", str(out)) == 0
    ckpt = checkpoint.latest_checkpoint(out)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    theirs.eval()
    ours = Llama(hf.llama_config_from_hf(json.loads((ckpt / "config.json").read_text())))
    hf.load_weights(ours, hf.weight_files(ckpt))
    ids = torch.randint(0, cfg["vocab_size"], (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)
