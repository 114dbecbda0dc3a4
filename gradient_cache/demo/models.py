"""A small nanoGPT-style language model, built in code, for examples and benchmarks.

Nothing is downloaded: the model is randomly initialised from a `GPTConfig`, and
`make_batches` cuts next-token training pairs out of any 1-D token tensor.

Shapes in comments: B batch, T sequence length, C d_model, H heads, V vocab_size.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import numbers
import string
import textwrap
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a `TinyGPT`.

    Attributes:
        vocab_size: number of token ids (256 for bytes).
        seq_len: longest sequence the learned position embedding covers.
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Invalid {name}: {value!r}; expected a positive integer.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"Invalid d_model: {self.d_model!r}; expected a multiple of "
                f"n_heads={self.n_heads} so every head gets the same width."
            )


GPT_SIZES: dict[str, GPTConfig] = {
    # About 0.83M parameters: trains on bytes in seconds on a laptop CPU.
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4),
    # About 14.0M parameters: large enough that gradient traffic is worth measuring.
    "small": GPTConfig(vocab_size=4096, seq_len=128, d_model=384, n_layers=7, n_heads=6),
    # About 22.9M parameters: "small" twelve blocks deep, so the embedding, whose encode
    # needs the most scratch, is a smaller share of the gradients.
    "medium": GPTConfig(vocab_size=4096, seq_len=128, d_model=384, n_layers=12, n_heads=6),
    # About 7.2M parameters (27.4 MiB in fp32), 99% of them in its 16 blocks: the vocabulary
    # is the corpus's bytes, so with the weights on the host (offload_parameters) the
    # embedding and head that stay on the device through a pass are small, and a block is
    # 1/16 of the weights, so the device's window of about two blocks (and a block's
    # gradients, and a pass's activations) fits under half of them.
    "bytes": GPTConfig(vocab_size=256, seq_len=64, d_model=192, n_layers=16, n_heads=3),
    # About 303M parameters (1.13 GiB in fp32): "bytes" for a GPU, where the allocator's
    # own overheads (the cuBLAS workspace, 20 MiB segments) would not fit under the cap
    # of a model of a few MiB.
    "bytes-xl": GPTConfig(vocab_size=256, seq_len=64, d_model=1024, n_layers=24, n_heads=16),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # [B, T, C]
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x [B, T, C]
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, C/H]
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # [B, T, C]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # [B, T, C] -> [B, T, 4C] -> [B, T, C]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # [B, T, C]
        return x + self.mlp(self.ln_mlp(x))  # [B, T, C]


class TinyGPT(nn.Module):
    """A decoder-only transformer whose output head shares the token embedding.

    ``activation_checkpointing``: in training, each block keeps only its input and runs
    its forward again during backward (``torch.utils.checkpoint``, non-reentrant), so
    activations stop setting the memory peak.
    """

    def __init__(self, config: GPTConfig, *, activation_checkpointing: bool = False) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {config!r}.")
        self.config = config
        self.activation_checkpointing = activation_checkpointing
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one parameter, one gradient
        self.apply(_init_weights)
        # GPT-2's scaling of the residual projections keeps the stream's variance flat in depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits [B, T, V], mean cross-entropy or None)`` for ``idx`` [B, T]."""
        _, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(
                f"Sequence length {t} exceeds the model's seq_len={self.config.seq_len}."
            )
        positions = torch.arange(t, device=idx.device)  # [T]
        x = self.tok_emb(idx) + self.pos_emb(positions)  # [B, T, C]
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)  # [B, T, C]
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # [B*T, V] vs [B*T]
        return logits, loss

    def num_parameters(self) -> int:
        """Unique parameters (the tied head counts once)."""
        return sum(p.numel() for p in self.parameters())  # parameters() skips duplicates


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_batches(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``tokens`` (1-D): inputs ``x`` [B, T] and next tokens ``y`` [B, T]."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}.")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(
            f"Invalid batch_size={batch_size!r} or seq_len={seq_len!r}; expected integers >= 1."
        )
    if tokens.numel() <= seq_len:
        raise ValueError(
            f"Need more than seq_len={seq_len} tokens to cut a window, got {tokens.numel()}."
        )
    starts = torch.randint(tokens.numel() - seq_len, (batch_size,), generator=generator)  # [B]
    offsets = starts.unsqueeze(1) + torch.arange(seq_len)  # [B, T]
    tokens = tokens.long()
    return tokens[offsets], tokens[offsets + 1]


# Standard-library sources: text every Python install has, so nothing is downloaded.
_CORPUS_MODULES = (argparse, dataclasses, string, textwrap)


def byte_corpus(*, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens (vocab 256) of a few stdlib modules' source: (train, validation)."""
    text = "\n".join(inspect.getsource(module) for module in _CORPUS_MODULES)
    tokens = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    cut = int(tokens.numel() * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def medium() -> TinyGPT:
    """The demo's default model, as a factory: ``gradient-cache plan --model
    gradient_cache.demo.models:medium`` plans the demo's own runs."""
    return TinyGPT(GPT_SIZES["medium"])
