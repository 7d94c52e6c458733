"""A GPT-2-style decoder in plain torch: LayerNorm, GELU MLP, learned positions, tied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    max_seq: int = 1024
    dropout: float = 0.0
    norm_eps: float = 1e-5


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.c_out = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + F.dropout(self.c_out(h), self.dropout, self.training)


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)[None]
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
