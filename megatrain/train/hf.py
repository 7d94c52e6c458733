"""Hugging Face Llama folders <-> megatrain.models.Llama, without `transformers`.

A folder holds `config.json` (LlamaForCausalLM) and optionally safetensors weights
(`model.safetensors`, or shards listed in `model.safetensors.index.json`). Tensor names:

    HF (LlamaForCausalLM)                                  megatrain.models.Llama
    model.embed_tokens.weight                              embed_tokens.weight
    model.layers.{i}.input_layernorm.weight                layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight       layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight       layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight        layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                                      norm.weight
    lm_head.weight (absent when tie_word_embeddings)       lm_head.weight

Both use the rotate-half RoPE layout, so q/k weights need no permutation. Configs the
model cannot compute exactly (biases, rope scaling, another head_dim, another activation)
are refused rather than approximated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatrain.models import LlamaConfig

from . import RefusedError

_RULES = [
    (r"embed_tokens\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight",
     r"model.layers.\1.\2.weight"),
    (r"layers\.(\d+)\.self_attn\.([qkvo]_proj)\.weight", r"model.layers.\1.self_attn.\2.weight"),
    (r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight", r"model.layers.\1.mlp.\2.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]
# HF checkpoints from older transformers carry these buffers; the model recomputes them.
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def to_hf_name(name: str) -> str:
    for pat, tmpl in _RULES:
        if re.fullmatch(pat, name):
            return re.sub(f"^{pat}$", tmpl, name)
    raise KeyError(f"no Hugging Face name for megatrain parameter {name!r}")


def from_hf_name(name: str) -> str:
    if name == "lm_head.weight":
        return name
    if name.startswith("model."):
        inner = name[len("model."):]
        for pat, _ in _RULES:
            if pat != r"lm_head\.weight" and re.fullmatch(pat, inner):
                return inner
    raise KeyError(f"unknown Hugging Face Llama tensor {name!r}")


# ---------------------------------------------------------------------------------- config

def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_config(folder: str | Path) -> dict:
    f = Path(folder) / "config.json"
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RefusedError(f"--model {folder}: cannot read {f} ({e}); it must be a Hugging Face "
                           f"config.json") from None


def llama_config_from_hf(hf: dict, where: str = "config.json") -> LlamaConfig:
    archs = hf.get("architectures") or []
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise RefusedError(f"{where}: model_type {hf.get('model_type')!r} / architectures {archs} "
                           f"is not a Llama-family model; megatrain train maps LlamaForCausalLM "
                           f"configs only (or use a preset: --model tiny|1b|3b|8b)")
    need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size"]
    missing = [k for k in need if k not in hf]
    if missing:
        raise RefusedError(f"{where}: missing {missing}; a Llama config needs {need}")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    unsupported = []
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        unsupported.append(f"hidden_act={hf['hidden_act']!r} (only silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        unsupported.append("attention_bias/mlp_bias=true (the model has no biases)")
    if hf.get("head_dim") not in (None, hidden // heads):
        unsupported.append(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    rope = hf.get("rope_parameters") or {}
    rope_type = (hf.get("rope_scaling") or {}).get("rope_type") or \
        (hf.get("rope_scaling") or {}).get("type") or rope.get("rope_type", "default")
    if rope_type != "default":
        unsupported.append(f"rope scaling {rope_type!r} (only plain RoPE)")
    if unsupported:
        raise RefusedError(f"{where}: megatrain.models.Llama cannot compute {', '.join(unsupported)}; "
                           f"use a config without them (training would silently differ)")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]), hidden=hidden, layers=int(hf["num_hidden_layers"]),
        heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn=int(hf["intermediate_size"]), rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def hf_config_from_llama(cfg: LlamaConfig, base: dict | None = None) -> dict:
    """A config.json `transformers` loads as LlamaForCausalLM; keeps unknown keys of `base`."""
    out = dict(base or {})
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn,
        "hidden_act": "silu", "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "head_dim": cfg.head_dim,
        "torch_dtype": "float32",
    })
    out.pop("rope_scaling", None)
    if "rope_parameters" in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return out


# --------------------------------------------------------------------------------- weights

def weight_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files and (list(folder.glob("pytorch_model*.bin")) or list(folder.glob("*.pt"))):
        raise RefusedError(f"--model {folder}: has pickle weights (pytorch_model*.bin / .pt) but no "
                           f"safetensors; convert them to safetensors, or remove them to start "
                           f"from random weights")
    return files


@torch.no_grad()
def load_weights(model: torch.nn.Module, files: list[Path], check_only: bool = False) -> None:
    """Copy HF-named safetensors tensors into `model` (cast to the parameter dtype), strictly.

    check_only: read only the file headers and check names and shapes (works on a meta model).
    """
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_embeddings", False)
    seen: set[str] = set()
    unexpected = []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for hf_name in fh.keys():
                if _IGNORED_HF.match(hf_name):
                    continue
                try:
                    name = from_hf_name(hf_name)
                except KeyError:
                    unexpected.append(hf_name)
                    continue
                if name not in params:
                    unexpected.append(hf_name)
                    continue
                shape = tuple(fh.get_slice(hf_name).get_shape())
                if shape != tuple(params[name].shape):
                    raise RefusedError(f"{f}: {hf_name} has shape {shape}, the config "
                                       f"makes {tuple(params[name].shape)}; config.json and the "
                                       f"weights disagree")
                if not check_only:
                    params[name].copy_(fh.get_tensor(hf_name))
                seen.add(name)
    if tied and "embed_tokens.weight" in seen:
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if unexpected or missing:
        raise RefusedError(f"weights in {files[0].parent} do not match the config: missing "
                           f"{[to_hf_name(m) for m in missing][:8]}, unexpected {unexpected[:8]}; "
                           f"use the config.json that came with these weights")


def save_weights(model: torch.nn.Module, folder: Path, shard_bytes: int = 4 << 30) -> list[Path]:
    """Write HF-named fp32 safetensors (sharded with an index above `shard_bytes`)."""
    from safetensors.torch import save_file

    tied = getattr(model.config, "tie_embeddings", False)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        tensors[to_hf_name(name)] = t.detach().to("cpu", torch.float32).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        path = folder / "model.safetensors"
        save_file(shards[0], str(path), metadata=meta)
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata=meta)
        paths.append(path)
        weight_map.update({n: path.name for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                indent=2))
    return paths + [index]
