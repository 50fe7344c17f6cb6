"""The policy: a small Qwen2-architecture causal LM built from a config (or any local HF causal LM)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 512
    attn_implementation: str = "eager"  # eager is faster than sdpa at this size on CPU

    def to_dict(self) -> dict:
        return asdict(self)


def build_model(cfg: ModelConfig, tokenizer, seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    hf_cfg._attn_implementation = cfg.attn_implementation
    model = Qwen2ForCausalLM(hf_cfg)
    return model


def load_model(path: str | Path, device: str = "cpu"):
    """Load a local Hugging Face causal LM and its tokenizer (nothing is downloaded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True)
    return model.to(device), tok


def n_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
