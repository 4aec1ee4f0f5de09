"""The DFlash drafter (arXiv 2602.06036): a block-diffusion network conditioned on target hidden states.

Every drafter layer attends to the projected target context (its own KV cache, grown only by
accepted positions) and, non-causally, to the whole block [last token, mask x (B-1)]; the target's
lm_head turns positions 1..B-1 into drafts. The checkpoint follows the z-lab layout (config.json
with `dflash_config`, weights fc / hidden_norm / layers.* / norm); embed_tokens and lm_head are the
target's. `load_drafter` validates every field and tensor with one-line errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from engines.errors import DrafterError
from engines.runtime.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS,
                                        SLIDING_FIELDS, Field, attention_types, check_rope, check_tensors,
                                        float_drafter, quantize_like, read_config, read_fields, read_tensors,
                                        refuse_unknown, refuse_unknown_fields, rope_settings, write_checkpoint)
from engines.runtime.hidden import activation_dtype, hidden_size, num_layers, vocab_size

# Every config.json field this loader reads, with its type and range (engines/runtime/checkpoint.py);
# fields that are bookkeeping pass (checkpoint.BOOKKEEPING, plus the two below), the DFlash2
# fields (conv + candidate selector) are refused, and so is anything else.
_METADATA = {"model_type", "tie_word_embeddings", "quantization"}  # z-lab's layers are Qwen3's; the head is the
#                                                                    target's; quantization: checkpoint.quantize_like
_FIELDS = {"hidden_size": Field("int", ge=1, le=MAX_WIDTH), "num_hidden_layers": Field("int", ge=1, le=MAX_LAYERS),
           "num_attention_heads": Field("int", ge=1, le=MAX_HEADS),
           "num_key_value_heads": Field("int", ge=1, le=MAX_HEADS), "head_dim": Field("int", ge=1, le=MAX_WIDTH),
           "intermediate_size": Field("int", ge=1, le=MAX_WIDTH), "rms_norm_eps": Field("number", gt=0, le=1),
           "max_position_embeddings": Field("int", ge=1, le=MAX_POSITIONS),
           "is_causal": Field("bool", None, null_ok=True),
           "num_target_layers": Field("int", None, ge=1, le=MAX_LAYERS, null_ok=True),
           "vocab_size": Field("int", None, ge=1, le=MAX_VOCAB, null_ok=True),
           "hidden_act": Field("str", "silu"), "attention_bias": Field("bool", False, null_ok=True),
           "dflash_config": Field("dict", {}, null_ok=True), **SLIDING_FIELDS}
# Read from dflash_config first, then the top level (z-lab's own precedence).
_NESTED = {"block_size": Field("int", None, ge=2, le=1024, null_ok=True),
           "target_layer_ids": Field("ints", None, ge=0, le=MAX_LAYERS, null_ok=True),
           "mask_token_id": Field("int", None, ge=0, le=MAX_VOCAB, null_ok=True),
           "final_logit_softcapping": Field("number", None, gt=0, null_ok=True)}
_NESTED_ONLY = {"input_embedding_scale": Field("number", 1.0), "output_multiplier": Field("number", 1.0)}
_DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # what initialize_rope takes (rope_parameters in v5 configs)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal inside the block, full layers not
    num_target_layers: int | None = None
    vocab_size: int | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings")

    @classmethod
    def from_json(cls, cfg: dict, where: str) -> "DFlashConfig":
        """Both z-lab schemas: the older one (block_size, rope_theta at the top) and the newer
        one (dflash_config.block_size, rope_parameters, layer_types with sliding windows), read
        with the precedence of z-lab's own loaders (dflash_config first, then the top level).
        Every field read is type- and range-checked: DrafterError names the file and the field."""
        dflash = read_fields(cfg, {"dflash_config": _FIELDS["dflash_config"]}, where)["dflash_config"]
        archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
        if "DFlash2DraftModel" in archs or any(dflash.get(k) for k in _DFLASH2):
            raise DrafterError(f"{where}: a DFlash2 drafter (grouped dynamic convolutions + candidate selector) is "
                               "not implemented by this engine; method=dflash_zlab runs z-lab's reference on it")
        refuse_unknown_fields(cfg, {*_FIELDS, *_NESTED, *ROPE_FIELDS, *_METADATA}, where)
        refuse_unknown_fields(dflash, {*_NESTED, *_NESTED_ONLY, *_DFLASH2}, where, prefix="dflash_config.")
        missing = [k for k in cls.REQUIRED if k not in cfg] + [f"dflash_config.{k}" for k in ("target_layer_ids",
                                                                                           "mask_token_id")
                                                               if dflash.get(k) is None and cfg.get(k) is None]
        if missing:
            raise DrafterError(f"{where}: missing {', '.join(missing)} (a z-lab DFlash config.json has them)")
        top, nested = read_fields(cfg, {**_FIELDS, **_NESTED}, where), read_fields(dflash, _NESTED, where, "dflash_config.")
        pick = lambda k, default=None: next((v for v in (nested[k], top[k]) if v is not None), default)
        if top["attention_bias"]:
            raise DrafterError(f"{where}: attention_bias=true is not implemented (z-lab drafters have no biases)")
        if top["hidden_act"] != "silu":
            raise DrafterError(f"{where}: hidden_act={top['hidden_act']!r} is not implemented (DFlash MLPs are SwiGLU)")
        n = top["num_hidden_layers"]
        types = attention_types(top, n, where)
        theta, scaling = rope_settings(cfg, where)
        check_rope(theta, scaling, top["head_dim"], top["max_position_embeddings"], where,
                   "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling")
        scales = read_fields(dflash, _NESTED_ONLY, where, "dflash_config.")
        return cls(**{k: top[k] for k in cls.REQUIRED}, block_size=pick("block_size", 16),
                   target_layer_ids=pick("target_layer_ids"), mask_token_id=pick("mask_token_id"),
                   rope_theta=theta, rope_scaling=scaling, layer_types=types,
                   sliding_window=top["sliding_window"] if "sliding_attention" in types else None,
                   is_causal=top["is_causal"], num_target_layers=top["num_target_layers"],
                   vocab_size=top["vocab_size"], final_logit_softcapping=pick("final_logit_softcapping"),
                   input_embedding_scale=scales["input_embedding_scale"],
                   output_multiplier=scales["output_multiplier"])

    def causal(self, layer: int) -> bool:
        """Whether layer `layer` attends causally inside the block (z-lab's rule and its training masks)."""
        return self.layer_types[layer] == "sliding_attention" if self.is_causal is None else self.is_causal

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.REQUIRED}
        out.update({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "rope_theta": self.rope_theta,
                    "block_size": self.block_size, "num_target_layers": self.num_target_layers,
                    "vocab_size": self.vocab_size, "layer_types": list(self.layer_types),
                    "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                                      "mask_token_id": self.mask_token_id}})
        for key in ("sliding_window", "rope_scaling", "is_causal", "final_logit_softcapping"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class DFlashAttention(nn.Module):
    stable = False  # attend over the context cache's whole buffer (engines/runtime/dispatch.py; set per engine)

    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.scale = cfg.num_attention_heads, cfg.num_key_value_heads, d ** -0.5
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
        self.causal = cfg.causal(layer)
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)

    def _heads(self, x, n, norm=None):
        # [1, T, n*D] -> [1, n, T, D]
        x = x.reshape(*x.shape[:2], n, -1)
        return (norm(x) if norm else x).transpose(0, 2, 1, 3)

    def __call__(self, x, ctx, rope, cache: KVCache | None = None, anchors: mx.array | None = None,
                 masks: dict | None = None):
        """x: [B, L, H] block; ctx: [B, S, H] projected context.

        Decoding (cache): ctx holds the new context positions; all context so far is
        kept in `cache` and the block starts right after it. Training (anchors [B]):
        ctx covers whole sequences and row b's block starts at anchors[b], seeing
        only context positions before it.
        """
        if cache is not None:
            return self._decode(x, ctx, rope, cache, masks if masks is not None else {})
        B, L = x.shape[:2]
        keys = rope(self._heads(self.k_proj(ctx), self.n_kv, self.k_norm), offset=0)
        values = self._heads(self.v_proj(ctx), self.n_kv)
        q = rope(self._heads(self.q_proj(x), self.n_heads, self.q_norm), offset=anchors)
        bk = rope(self._heads(self.k_proj(x), self.n_kv, self.k_norm), offset=anchors)
        bv = self._heads(self.v_proj(x), self.n_kv)
        C, n_ctx = keys.shape[2], anchors[:, None, None, None]
        qpos = n_ctx + mx.arange(L)[:, None]  # [B, 1, L, 1] absolute query positions
        kpos = mx.arange(C + L)[None]  # [1, C + L]: context positions, then the block
        visible = kpos < n_ctx  # context before the block, by absolute position
        if self.window:
            visible = visible & (qpos - kpos < self.window)
        block = kpos >= C
        if self.causal:  # block row i sees rows 0..i
            block = block & (kpos - C <= qpos - n_ctx)
        out = mx.fast.scaled_dot_product_attention(q, mx.concatenate([keys, bk], axis=2),
                                                   mx.concatenate([values, bv], axis=2), scale=self.scale,
                                                   mask=visible | block)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def write_context(self, ctx, rope, cache: KVCache) -> None:
        """Append the K/V of new context rows [1, S, H] to `cache` with no block: the same
        rows _decode would write ahead of a block (they never depend on the block)."""
        k = rope(self._heads(self.k_proj(ctx), self.n_kv, self.k_norm), offset=cache.offset)
        cache.update_and_fetch(k, self._heads(self.v_proj(ctx), self.n_kv))

    def _decode(self, x, ctx, rope, cache: KVCache, masks: dict):
        # The new context and the block sit at consecutive positions, so their K/V are one
        # projection over [ctx; block] rows, one norm, one rope, and one cache write; the
        # block's rows are dropped from the cache again after attending (offset moves back).
        B, L, S = x.shape[0], x.shape[1], ctx.shape[1]
        start = cache.offset
        rows = mx.concatenate([ctx, x], axis=1)  # [1, S + L, H]
        k = rope(self._heads(self.k_proj(rows), self.n_kv, self.k_norm), offset=start)
        keys, values = cache.update_and_fetch(k, self._heads(self.v_proj(rows), self.n_kv))  # [1, Hkv, n+L, D]
        if self.stable:  # the whole buffer, its unwritten tail masked: one cuDNN plan per 256 keys
            keys, values = cache.keys, cache.values
        cache.trim(L)  # the block was written only to be attended to
        q = rope(self._heads(self.q_proj(x), self.n_heads, self.q_norm), offset=start + S)
        key = (self.window, self.causal, keys.shape[2])
        if key not in masks:  # layers alike share one mask per forward
            masks[key] = _block_mask(start + S, L, keys.shape[2], self.window, self.causal)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=masks[key])
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _block_mask(n_ctx: int, L: int, C: int, window: int | None, causal: bool) -> mx.array | None:
    """[L, C] which keys each block row sees: context before the block (within `window`), and
    the block itself (rows 0..i if causal); keys past the block are never seen. None: all."""
    if C == n_ctx + L and not window and not causal:
        return None
    qpos = n_ctx + mx.arange(L)[:, None]  # [L, 1] absolute query positions
    kpos = mx.arange(C)[None]  # [1, C]
    visible = kpos < n_ctx
    if window:
        visible = visible & (qpos - kpos < window)
    block = (kpos >= n_ctx) & (kpos <= (qpos if causal else n_ctx + L - 1))
    return visible | block


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)  # SwiGLU gate/up/down, as in Qwen3
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, ctx, rope, cache=None, anchors=None, masks=None):
        h = x + self.self_attn(self.input_layernorm(x), ctx, rope, cache, anchors, masks)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DFlashLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._rope = initialize_rope(cfg.head_dim, base=cfg.rope_theta, traditional=False,
                                     scaling_config=cfg.rope_scaling,
                                     max_position_embeddings=cfg.max_position_embeddings)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def logits(self, raw: mx.array) -> mx.array:
        """The target head's raw logits scaled and soft-capped as this drafter's config says."""
        c = self.config
        out = raw * c.output_multiplier if c.output_multiplier != 1.0 else raw
        if c.final_logit_softcapping:
            out = mx.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out

    def project_context(self, target_hidden: mx.array) -> mx.array:
        # [1, S, n*H] concatenated target layer outputs -> [1, S, H]
        if target_hidden.shape[1] == 0:  # MLX's CUDA backend faults on a zero-row matmul or norm
            return mx.zeros((target_hidden.shape[0], 0, self.fc.weight.shape[0]), dtype=target_hidden.dtype)
        return self.hidden_norm(self.fc(target_hidden))

    def feed_context(self, ctx: mx.array, cache: list[KVCache]) -> None:
        """Write [1, S, H] projected context into every layer's cache, ahead of any block."""
        for layer, c in zip(self.layers, cache):
            layer.self_attn.write_context(ctx, self._rope, c)

    def __call__(self, block_embeds: mx.array, ctx: mx.array, cache: list[KVCache] | None = None,
                 anchors: mx.array | None = None) -> mx.array:
        """[B, L, H] block embeddings + [B, S, H] context -> [B, L, H] normed hidden states
        (decoding with `cache`, or training with per-row block `anchors`)."""
        h, masks = block_embeds, {}
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, self._rope, cache[i] if cache is not None else None, anchors, masks)
        return self.norm(h)


# ---------------------------------------------------------------- checkpoint layout

def save_drafter(drafter: DFlashDrafter, path: Path, dtype=mx.bfloat16) -> None:
    write_checkpoint(path, drafter.config.to_json(), dict(tree_flatten(drafter.parameters())), dtype)


def read_drafter_config(path: Path) -> tuple[DFlashConfig, dict]:
    """The checked config of the DFlash drafter at `path` (and its raw JSON), weights unread."""
    raw = read_config(path, "a DFlash drafter")
    return DFlashConfig.from_json(raw, str(path / "config.json")), raw


def load_drafter(path: Path, target_model: nn.Module) -> DFlashDrafter:
    """Load and validate a z-lab DFlash drafter for `target_model`; DrafterError naming the file."""
    path = Path(path)
    where = path / "config.json"
    cfg, raw = read_drafter_config(path)
    n_target, h_target = num_layers(target_model), hidden_size(target_model)
    vocab = vocab_size(target_model)
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_target]
    if bad or not cfg.target_layer_ids:
        raise DrafterError(f"{where}: dflash_config.target_layer_ids {list(cfg.target_layer_ids)} must be within the "
                           f"target's {n_target} layers (0..{n_target - 1})")
    if cfg.hidden_size != h_target:
        raise DrafterError(f"{where}: drafter hidden_size {cfg.hidden_size} != target hidden size {h_target}: "
                           "this drafter was trained for another target")
    if not 0 <= cfg.mask_token_id < vocab:
        raise DrafterError(f"{where}: dflash_config.mask_token_id {cfg.mask_token_id} is outside the target vocab "
                           f"(0..{vocab - 1})")
    weights = read_tensors(path, lambda k: k.removeprefix("model."))
    drafter = DFlashDrafter(cfg)
    packed = quantize_like(drafter, weights, raw, where)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}  # every z-lab tensor
    check_tensors(weights, expected, "drafter", path, packed)
    # a copy of the target's embedding or head is redundant (the drafter uses the target's own),
    # but it must still be the target's shape: anything else is a damaged or foreign checkpoint
    copies = {k: (vocab, h_target) for k in ("embed_tokens.weight", "lm_head.weight") if k in weights}
    check_tensors(weights, copies, "drafter", path)
    refuse_unknown(weights, {*expected, *copies}, "tensor(s)", path,
                   "this drafter has parts the engine would not run; use a z-lab DFlash checkpoint")
    drafter.load_weights([(k, weights[k]) for k in expected])
    drafter.set_dtype(activation_dtype(target_model))
    drafter.eval()
    float_drafter(drafter, activation_dtype(target_model))
    mx.eval(drafter.parameters())
    return drafter


# ---------------------------------------------------------------- engines
