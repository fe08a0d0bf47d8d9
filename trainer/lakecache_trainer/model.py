"""Llama-architecture decoders from a config (random init), by size name."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from .shards import VOCAB_SIZE

# hidden, layers, heads, kv heads, intermediate
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 4, 176),
    "small": (512, 8, 8, 8, 1376),
    "1b": (2048, 16, 16, 16, 5504),
    "3b": (3072, 26, 24, 24, 8192),
    "7b": (4096, 32, 32, 32, 11008),
    "8b": (4096, 32, 32, 8, 14336),
}


def build_model(size: str, seq_len: int) -> LlamaForCausalLM:
    if size not in PRESETS:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(PRESETS)}")
    hidden, layers, heads, kv_heads, inter = PRESETS[size]
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE + 63,  # padded to a multiple of 64
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def flops_per_token(n_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus attention scores."""
    return 6.0 * n_params + 12.0 * layers * hidden * seq_len
