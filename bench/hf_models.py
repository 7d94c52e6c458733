"""The Hugging Face models bench/hf_train.py trains: stock `transformers` classes built from
a config with random init (nothing downloaded, no line of the model changed), at the shapes
of released checkpoints of each family, and the same models scaled down for --smoke.

They are the point of the bench: megatrain's own Llama (bench/train.py) was written beside
the backend, these were not. One module, so that the parent, every child and the test
build exactly the same shape from the same name. Imports torch and transformers lazily:
bench/readme_table.py reads MODELS without them.
"""

from __future__ import annotations

# bench name -> (family, transformers config class, the config's arguments). Every model
# trains without a KV cache (use_cache=False: training never reads one, and building one
# per call is a side effect the compiled graph would have to replay).
MODELS: dict[str, tuple[str, str, dict]] = {
    # the shape of megatrain's own "1b" preset (bench/train.py --model 1.3b): the same
    # architecture written by Hugging Face, not by this project
    "llama-1.3b": ("llama", "LlamaConfig", dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=5504, vocab_size=32000, max_position_embeddings=4096)),
    # the "3b" preset's shape (bench/train.py --model 3b), for the same comparison
    "llama-3b": ("llama", "LlamaConfig", dict(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=24,
        intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096)),
    # Qwen2-1.5B: grouped-query attention with q/k/v biases, a vocabulary 100x the width,
    # tied to the embedding
    "qwen2-1.5b": ("qwen2", "Qwen2Config", dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768)),
    # a 3B-class Mistral: 8 key/value heads for 24 query heads, full attention (the family's
    # sliding window off, as in Mistral v0.2 and later)
    "mistral-3b": ("mistral", "MistralConfig", dict(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, vocab_size=32768, sliding_window=None,
        max_position_embeddings=32768)),
    # Gemma-2-2B: transformers' Gemma2Config defaults are this shape; spelled out so that a
    # change of defaults cannot change the model. Soft-capped attention and logits, local
    # (sliding window 4096) and global layers alternating; at seq 2048 the window covers
    # the whole sequence, so local layers attend like global ones.
    "gemma2-2b": ("gemma2", "Gemma2Config", dict(
        hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, intermediate_size=9216, vocab_size=256000, tie_word_embeddings=True,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
        sliding_window=4096, max_position_embeddings=8192)),
    # Qwen2-7B (the family of MegaTrain's own SFT runs): GQA 28/4 with q/k/v biases, a
    # 152k vocabulary with an untied head; 7.6 G params, 122 GB of fp32 weights, gradients
    # and AdamW moments: no 80 GB GPU holds it resident
    "qwen2-7b": ("qwen2", "Qwen2Config", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
        rope_theta=1000000.0, max_position_embeddings=32768)),
    # A Qwen3 mixture of experts small enough to train GPU-resident: 16 experts, 2 per token,
    # every layer sparse
    "qwen3-moe-0.7b": ("qwen3_moe", "Qwen3MoeConfig", dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=448, norm_topk_prob=True,
        decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=32768)),
    # ... and one whose fp32 weights, gradients and AdamW moments (16 B/param) exceed an
    # H100's 80 GB: 48 experts, 2 per token (about 1/20 of the expert weights per token)
    "qwen3-moe-6b": ("qwen3_moe", "Qwen3MoeConfig", dict(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
        num_experts=48, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=32768)),
}

# --smoke: every model at a few layers of a small width and vocabulary, its architecture
# otherwise as above (GQA ratios, biases, tying, soft-capping, experts and routing).
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, max_position_embeddings=256)
SMOKE_EXTRA = {
    "mistral": dict(head_dim=16),
    # a window shorter than the smoke's sequence, so the local layers do mask
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16),
    "qwen3_moe": dict(moe_intermediate_size=32),
}
SMOKE_EXPERTS_SHARE = 4  # --smoke: a quarter of the experts per layer (2 per token as above)


def family(name: str) -> str:
    return MODELS[name][0]


def layers(name: str) -> int:
    return MODELS[name][2]["num_hidden_layers"]


def config(name: str, smoke: bool = False, layers: int | None = None):
    """The model's transformers config (scaled down for --smoke; `layers`: another depth at
    the same width)."""
    import transformers

    fam, cls, kwargs = MODELS[name]
    kwargs = dict(kwargs, use_cache=False, **({"num_hidden_layers": layers} if layers else {}))
    if smoke:
        kwargs.update(SMOKE, **SMOKE_EXTRA.get(fam, {}))
        if "num_experts" in kwargs:
            kwargs["num_experts"] = kwargs["num_experts"] // SMOKE_EXPERTS_SHARE
    return getattr(transformers, cls)(**kwargs)


def build(name: str, smoke: bool = False, device=None, layers: int | None = None):
    """(model in train mode, the attention implementation it got, why not SDPA or None).
    Seeded: every system starts from the same weights. SDPA is asked for; a model class
    transformers refuses it for (Gemma2: SDPA has no soft-capping) gets "eager" and the
    refusal is returned for the row. `layers`: another depth at the same width."""
    import torch
    import transformers

    cfg = config(name, smoke, layers)
    torch.manual_seed(0)
    ctx = torch.device(device) if device is not None else _nullcontext()
    with ctx:
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
            why = None
        except ValueError as e:
            why = " ".join(str(e).split())[:300]
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.train()
    return model, model.config._attn_implementation, why


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def param_count(name: str, smoke: bool = False) -> int:
    """Parameters (a tied weight once), counted on the meta device: no memory, no init."""
    model, _, _ = build(name, smoke, device="meta")
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model, seq: int) -> float:
    """Training FLOPs per token as bench/train.py counts them: 6 x the matmul parameters a
    token goes through (every nn.Linear, the LM head included, once per tied weight; of an
    expert stack, a 3-D parameter [experts, out, in], the num_experts_per_tok / num_experts
    share a token is routed through) + 12 x the query width x the keys each query attends
    (seq, or the sliding window where shorter) summed over the layers; recompute not
    counted."""
    from torch import nn

    cfg = model.config
    seen, dense, experts = set(), 0, 0
    for module in model.modules():
        weights = [module.weight] if isinstance(module, nn.Linear) else []
        weights += [p for p in module.parameters(recurse=False) if p.dim() == 3]
        for w in weights:
            if id(w) not in seen:
                seen.add(id(w))
                if w.dim() == 3:
                    experts += w.numel()
                else:
                    dense += w.numel()
    active = dense + experts * getattr(cfg, "num_experts_per_tok", 0) / max(getattr(cfg, "num_experts", 0) or 1, 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_attention_heads * head_dim
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or seq
    keys = sum(min(window, seq) if kind == "sliding_attention" else seq for kind in kinds)
    return 6.0 * active + 12.0 * width * keys


def mlp_shape(name: str) -> tuple[int, int]:
    """(hidden, ffn) of the matmul the probe times for MFU: the dense MLP's; for a mixture
    of experts a dense MLP 4x its width, the rate its GPU reaches at this width (a routed
    expert's GEMM of a few hundred rows never does, and MFU is against what the GPU can)."""
    kwargs = MODELS[name][2]
    hidden = kwargs["hidden_size"]
    return hidden, (4 * hidden if "num_experts" in kwargs else kwargs["intermediate_size"])
