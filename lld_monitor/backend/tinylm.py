"""The built-in policy's forward: the Qwen2 architecture, written for a small model on one CPU thread.

`transformers`' Qwen2ForCausalLM spends most of a 128-wide, 2-layer model's time in per-call overhead
(modules, masks, cache objects; ≈ 25 ms a call). `TinyLM` computes the same function with a few dozen
tensor ops a call: q/k/v and gate/up projections fused into one matrix each, grouped-query attention
without repeating keys, a preallocated key/value cache for the rollout, and logits only where they are
asked for (the trainer needs them at action tokens only). With `fixed_matmul` (the trainer's pinned
numerics) every matrix product goes through `matmul.py`'s fixed-order kernel, so a row's log-probs are
the same bits on any AVX2 CPU and in any batch.

Checkpoints stay Hugging Face model directories: `save_pretrained` writes Qwen2's config.json and its
parameter names, `from_pretrained` reads them (no transformers import), and `tests/test_backend_tinylm.py`
pins the logits to Qwen2ForCausalLM's on the same weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from . import matmul as fixed

ROPE_THETA = 10000.0
RMS_EPS = 1e-6
# ATen's softmax over fewer than 8 values (one AVX2 vector) takes another path than over 8 or more, and
# rounds differently (measured): attention over fewer keys is padded with masked keys, so that a token's
# logits are the same bits whatever number of positions its call holds (decoding = full forward).
MIN_KEYS = 8


@dataclass(frozen=True)
class TinyLMShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int
    pad_token_id: int = 0
    eos_token_id: int | None = None
    rope_theta: float = ROPE_THETA
    rms_norm_eps: float = RMS_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def hf_config(shape: TinyLMShape) -> dict:
    """The config.json of the same model as transformers' Qwen2ForCausalLM."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": shape.eos_token_id,
        "pad_token_id": shape.pad_token_id,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": shape.vocab_size,
    }


def shape_from_hf_config(cfg: dict) -> TinyLMShape:
    """TinyLM's shape from a Qwen2 config.json; ValueError for anything TinyLM does not compute."""
    if cfg.get("model_type") != "qwen2":
        raise ValueError(f"TinyLM computes Qwen2 models only, not model_type {cfg.get('model_type')!r}")
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", ROPE_THETA), "rope_type": "default"}
    unsupported = {
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True) is not True,
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "use_sliding_window": bool(cfg.get("use_sliding_window", False)),
        "rope_type": rope.get("rope_type", "default") != "default",
        "head_dim": cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"TinyLM does not compute this Qwen2 variant ({', '.join(bad)}); use the Hugging Face model")
    return TinyLMShape(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        intermediate_size=cfg["intermediate_size"], max_positions=cfg["max_position_embeddings"],
        pad_token_id=cfg.get("pad_token_id") or 0, eos_token_id=cfg.get("eos_token_id"),
        rope_theta=float(rope.get("rope_theta", ROPE_THETA)), rms_norm_eps=float(cfg.get("rms_norm_eps", RMS_EPS)),
    )


class Block(nn.Module):
    """One decoder layer: pre-norm attention and SwiGLU MLP, q/k/v and gate/up fused."""

    def __init__(self, s: TinyLMShape):
        super().__init__()
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.ln1 = nn.Parameter(torch.ones(s.hidden_size))
        self.qkv_w = nn.Parameter(torch.empty(qkv, s.hidden_size))
        self.qkv_b = nn.Parameter(torch.zeros(qkv))
        self.o_w = nn.Parameter(torch.empty(s.hidden_size, s.num_heads * s.head_dim))
        self.ln2 = nn.Parameter(torch.ones(s.hidden_size))
        self.gate_up_w = nn.Parameter(torch.empty(2 * s.intermediate_size, s.hidden_size))
        self.down_w = nn.Parameter(torch.empty(s.hidden_size, s.intermediate_size))


class TinyLM(nn.Module):
    """A Qwen2 causal LM (tied embeddings, RoPE, GQA, SwiGLU, RMSNorm) with a small-model forward."""

    def __init__(self, shape: TinyLMShape, fixed_matmul: bool = False):
        super().__init__()
        s = self.shape = shape
        if s.hidden_size % s.num_heads or s.num_heads % s.num_kv_heads or s.head_dim % 2:
            raise ValueError(f"TinyLM: bad head layout {s}")
        self.fixed_matmul = fixed_matmul
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.num_layers)])
        self.norm = nn.Parameter(torch.ones(s.hidden_size))
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float) / s.head_dim))
        freqs = torch.arange(s.max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    # ---------------------------------------------------------------- parameters
    def init_weights(self, seed: int) -> None:
        """Qwen2's initialisation: normal(0, 0.02) matrices and embedding, zero biases, unit norms."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("ln1", "ln2")) or name == "norm":
                    p.fill_(1.0)
                elif name.endswith("_b"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            self.embed.weight[self.shape.pad_token_id].zero_()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Embedding:
        """The output head: the input embedding itself (tied, as Qwen2's tie_word_embeddings)."""
        return self.embed

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The parameters under Qwen2ForCausalLM's names (fused matrices split)."""
        s = self.shape
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm}
        for i, b in enumerate(self.blocks):
            p = f"model.layers.{i}."
            for part, w, bias in zip(("q", "k", "v"), b.qkv_w.split([q, kv, kv]), b.qkv_b.split([q, kv, kv])):
                out[p + f"self_attn.{part}_proj.weight"] = w
                out[p + f"self_attn.{part}_proj.bias"] = bias
            out[p + "self_attn.o_proj.weight"] = b.o_w
            gate, up = b.gate_up_w.chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = b.down_w
            out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = b.ln1, b.ln2
        return {k: v.detach().contiguous() for k, v in out.items()}

    def load_hf_state_dict(self, sd: dict[str, Tensor]) -> None:
        """Load Qwen2ForCausalLM's parameters (a missing or extra name is an error)."""
        mine = self.hf_state_dict()
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied to the embedding
        missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
        if missing or extra:
            raise ValueError(f"checkpoint does not fit TinyLM: missing {missing[:4]}, unexpected {extra[:4]}")
        with torch.no_grad():
            self.embed.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.copy_(sd["model.norm.weight"])
            for i, b in enumerate(self.blocks):
                p = f"model.layers.{i}."
                b.qkv_w.copy_(torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
                b.qkv_b.copy_(torch.cat([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]))
                b.o_w.copy_(sd[p + "self_attn.o_proj.weight"])
                b.gate_up_w.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
                b.down_w.copy_(sd[p + "mlp.down_proj.weight"])
                b.ln1.copy_(sd[p + "input_layernorm.weight"])
                b.ln2.copy_(sd[p + "post_attention_layernorm.weight"])

    def save_pretrained(self, out_dir: str | Path) -> None:
        """A Hugging Face model directory (config.json + model.safetensors) that Qwen2ForCausalLM loads."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config(self.shape), indent=2) + "\n", encoding="utf-8")
        save_file(self.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, path: str | Path, fixed_matmul: bool = False) -> TinyLM:
        p = Path(path)
        shape = shape_from_hf_config(json.loads((p / "config.json").read_text(encoding="utf-8")))
        model = cls(shape, fixed_matmul=fixed_matmul)
        model.load_hf_state_dict(load_file(str(p / "model.safetensors")))
        return model

    # ---------------------------------------------------------------- math
    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        return fixed.linear(x, w, b) if self.fixed_matmul else F.linear(x, w, b)

    def _matmul(self, a: Tensor, b: Tensor) -> Tensor:
        if not self.fixed_matmul:
            return torch.matmul(a, b)
        lead = a.shape[:-2]
        out = fixed.matmul(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
        return out.reshape(*lead, *out.shape[-2:])

    def _rms(self, x: Tensor, w: Tensor) -> Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps))

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate [..., S, heads, head_dim] by the angles of its positions (cos/sin: [..., S, 1, head_dim/2])."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _qkv(self, b: Block, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, kv, g, S, d], k and v [B, kv, S, d] of the normed hidden states h [B, S, H]."""
        s = self.shape
        nb, n = h.shape[0], h.shape[1]
        qkv = self._linear(h, b.qkv_w, b.qkv_b).view(nb, n, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        qk = self._rope(qkv[:, :, : s.num_heads + s.num_kv_heads], cos, sin)
        q = qk[:, :, : s.num_heads].view(nb, n, s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)
        k = qk[:, :, s.num_heads :]
        v = qkv[:, :, s.num_heads + s.num_kv_heads :]
        return q.permute(0, 2, 3, 1, 4), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """softmax(q kᵀ / √d + bias) v for q [B, kv, g, S, d], k/v [B, kv, L, d], bias [B, 1, 1, S, L] -> [B, S, H]."""
        nb, nkv, g, n, d = q.shape
        if k.shape[-2] < MIN_KEYS:  # see MIN_KEYS: masked zero keys up to 8, so softmax takes its usual path
            extra = MIN_KEYS - k.shape[-2]
            k, v = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra))
            bias = F.pad(bias, (0, extra), value=torch.finfo(bias.dtype).min)
        q = q.reshape(nb, nkv, g * n, d) * d**-0.5  # scaled before the product: the smaller tensor
        probs = torch.softmax(self._matmul(q, k.transpose(-1, -2)).view(nb, nkv, g, n, -1).add_(bias), dim=-1)
        out = self._matmul(probs.view(nb, nkv, g * n, -1), v).view(nb, nkv, g, n, d)
        return out.permute(0, 3, 1, 2, 4).reshape(nb, n, nkv * g * d)

    def _block(self, b: Block, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor, cache=None) -> Tensor:
        q, k, v = self._qkv(b, self._rms(x, b.ln1), cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        x = x + self._linear(self._attend(q, k, v, bias), b.o_w)
        gate, up = self._linear(self._rms(x, b.ln2), b.gate_up_w).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, b.down_w)

    def _angles(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope_cos[position_ids].unsqueeze(-2), self.rope_sin[position_ids].unsqueeze(-2)

    def logits_of(self, hidden: Tensor) -> Tensor:
        """Final norm and the tied output head on hidden states [..., H]."""
        return self._linear(self._rms(hidden, self.norm), self.embed.weight)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, select: Tensor | None = None) -> Tensor:
        """Logits of a left-padded batch [B, S] (causal, padding masked): all [B, S, V], or at the positions
        where the bool mask `select` [B, S] is True, in row-major order [n_selected, V]."""
        x = self.embed(input_ids)
        cos, sin = self._angles(position_ids)
        n = input_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, torch.finfo(x.dtype).min)
        bias = bias[:, None, None]
        for b in self.blocks:
            x = self._block(b, x, cos, sin, bias)
        return self.logits_of(x if select is None else x[select])

    # ---------------------------------------------------------------- generation
    def decoder(self, batch: int, max_len: int) -> KVDecoder:
        return KVDecoder(self, batch, max_len)


class _LayerWrite:
    """One layer's part of a decoder call: write the new keys/values, return what the call attends over."""

    def __init__(self, k: Tensor, v: Tensor, rows: Tensor | None, cols: Tensor, width: int):
        self.k, self.v, self.rows, self.cols, self.width = k, v, rows, cols, width

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n_rows, heads = k.shape[0], k.shape[1]
        r = (self.rows if self.rows is not None else torch.arange(n_rows, device=k.device))[:, None, None]
        h = torch.arange(heads, device=k.device)[None, :, None]
        c = self.cols[:, None, :]
        self.k[r, h, c] = k
        self.v[r, h, c] = v
        if self.rows is None:
            return self.k[:, :, : self.width], self.v[:, :, : self.width]
        return self.k[self.rows, :, : self.width], self.v[self.rows, :, : self.width]


class KVDecoder:
    """Incremental decoding over a preallocated cache in which every row fills its own columns.

    `start` runs the left-padded prompts; `feed` appends any number of tokens to any rows (one sampled
    token to every row, or a tool observation of 40 tokens to a few rows, in one call each) and returns
    the logits after each row's last new token. A row's keys sit at its own next free columns, its
    position ids count its real tokens, and padding is masked, so the logits are those of the row's
    tokens in one full forward (`tests/test_backend_tinylm.py`).
    """

    def __init__(self, model: TinyLM, batch: int, max_len: int):
        s = model.shape
        p = model.embed.weight
        self.model = model
        shape = (batch, s.num_kv_heads, max_len, s.head_dim)
        # zeros, not empty: a row attends over columns other rows have filled and it has not (masked, but
        # an uninitialised NaN would survive the mask)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.blocks]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.blocks]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=p.device)
        self.length = torch.zeros(batch, dtype=torch.long, device=p.device)  # next free column
        self.n_real = torch.zeros(batch, dtype=torch.long, device=p.device)  # next position id

    @torch.no_grad()
    def start(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Run left-padded prompts [B, P] (mask 1 = real token); logits after each prompt [B, V]."""
        counts = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        return self._run(None, input_ids, counts, attention_mask.bool())

    @torch.no_grad()
    def feed(self, rows: Tensor | None, tokens: Tensor, counts: Tensor) -> Tensor:
        """Append tokens [R, n] to `rows` (None: every row, in order), the first counts[i] of row i real
        (the rest padding, counts[i] may be 0); logits after each row's last real token [R, V]."""
        n = tokens.shape[1]
        real = torch.arange(n, device=tokens.device)[None, :] < counts[:, None]
        return self._run(rows, tokens, counts, real)

    def _run(self, rows: Tensor | None, tokens: Tensor, counts: Tensor, real: Tensor) -> Tensor:
        m = self.model
        sel = slice(None) if rows is None else rows
        n = tokens.shape[1]
        steps = torch.arange(n, device=tokens.device)[None, :]
        cols = self.length[sel][:, None] + steps
        if int(cols.max()) >= self.valid.shape[1]:
            raise ValueError(f"decoder cache full ({self.valid.shape[1]} columns)")
        positions = (self.n_real[sel][:, None] + real.long().cumsum(-1) - 1).clamp(min=0)
        self.valid[(torch.arange(len(cols), device=cols.device) if rows is None else rows)[:, None], cols] = real
        width = int(cols.max()) + 1
        keys = self.valid[sel, :width][:, None, :] & (torch.arange(width, device=cols.device)[None, None, :] <= cols[:, :, None])
        bias = torch.zeros(keys.shape, dtype=m.embed.weight.dtype, device=keys.device)
        bias = bias.masked_fill_(~keys, torch.finfo(bias.dtype).min)[:, None, None]
        x = m.embed(tokens)
        cos, sin = m._angles(positions)
        for b, k, v in zip(m.blocks, self.k, self.v):
            x = m._block(b, x, cos, sin, bias, _LayerWrite(k, v, rows, cols, width))
        if rows is None:
            self.length += counts
            self.n_real += real.sum(-1)
        else:
            self.length[rows] += counts
            self.n_real[rows] += real.sum(-1)
        last = (counts - 1).clamp(min=0)
        return m.logits_of(x[torch.arange(len(last), device=x.device), last])
