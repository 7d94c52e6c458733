"""Reference models in plain torch and the presets `megatrain train --model` knows."""

from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    # tiny: trains on 2 CPU cores in about a minute; byte-level vocab.
    "tiny": LlamaConfig(vocab_size=256, hidden=128, layers=4, heads=4, kv_heads=2, ffn=344,
                        rope_theta=10000.0, max_seq=512),
    "1b": LlamaConfig(vocab_size=32000, hidden=2048, layers=24, heads=16, kv_heads=16, ffn=5504,
                      rope_theta=10000.0, max_seq=4096),
    "3b": LlamaConfig(vocab_size=32000, hidden=3072, layers=28, heads=24, kv_heads=24, ffn=8192,
                      rope_theta=10000.0, max_seq=4096),
    "8b": LlamaConfig(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                      rope_theta=500000.0, max_seq=8192),
}

__all__ = ["GPT2", "GPT2Config", "Llama", "LlamaConfig", "PRESETS"]
