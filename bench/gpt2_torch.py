"""GPT-2 small in PyTorch, written here for loom's benchmarks (pytorch_compare.py on the CPU,
pytorch_gpu.py on a GPU): pre-LayerNorm blocks, causal self-attention, GELU (tanh), tied
input/output embeddings, learned position embeddings, no dropout, GPT-2's initialisation.
With `checkpoint_blocks` each block keeps only its input and runs again in the backward
(torch.utils.checkpoint, non-reentrant), loom's `--recompute-layers all`.
Import it after setting any environment the torch import reads."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# GPT-2 small (DESIGN.md, include/loom/models/gpt2/config.hpp).
VOCAB = 50257
PADDED_VOCAB = 50304
MAX_SEQ = 1024
LAYERS, HEADS, CHANNELS = 12, 12, 768


class CausalSelfAttention(nn.Module):
    def __init__(self, channels, heads, max_seq):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.use_sdpa = hasattr(F, "scaled_dot_product_attention")  # PyTorch >= 2.0
        if not self.use_sdpa:
            mask = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, max_seq, max_seq), persistent=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, channels, heads, max_seq):
        super().__init__()
        self.ln_1 = nn.LayerNorm(channels)
        self.attn = CausalSelfAttention(channels, heads, max_seq)
        self.ln_2 = nn.LayerNorm(channels)
        self.fc = nn.Linear(channels, 4 * channels)
        self.fc_proj = nn.Linear(4 * channels, channels)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab_rows, checkpoint_blocks=False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.wte = nn.Embedding(vocab_rows, CHANNELS)
        self.wpe = nn.Embedding(MAX_SEQ, CHANNELS)
        self.blocks = nn.ModuleList(Block(CHANNELS, HEADS, MAX_SEQ) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(CHANNELS)
        self.lm_head = nn.Linear(CHANNELS, vocab_rows, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2L), zero biases.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        t = tokens.size(1)
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
