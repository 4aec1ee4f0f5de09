"""DFlash: a block-diffusion drafter conditioned on target hidden states (arXiv 2602.06036).

One round:
  block [last token, mask x (B-1)] -> drafter forward: every drafter layer attends to
  the projected target context (its own KV cache, grown only by accepted positions)
  and, non-causally, to the whole block -> target lm_head on positions 1..B-1 ->
  B-1 drafts -> verify -> accept prefix + bonus -> rollback -> the accepted
  positions' target hidden states become the drafter's next context.

Two verify strategies share everything else:
- dflash_a (Option A): verify the block incrementally at the end of the output
  (start position = len(output) - 1) and roll back the rejected tail exactly,
  DeltaNet state included (engines/cache.py).
- dflash_c (Option C): re-prefill the whole sequence from position 0 every round,
  so nothing is ever rolled back, at a cost that grows with the context.

The drafter checkpoint follows the z-lab layout (config.json with `dflash_config`,
weights fc / hidden_norm / layers.* / norm); embed_tokens and lm_head are the
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

from engines.base import Draft, Engine
from engines.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, SLIDING_FIELDS,
                                Field, check_rope, check_tensors, attention_types, float_drafter, quantize_like, read_config, read_fields, read_tensors,
                                refuse_unknown, refuse_unknown_fields, rope_settings, write_checkpoint)
from engines.device import DeviceEngine
from engines.errors import DrafterError
from engines.gemm import small_m_linears
from engines.hidden import activation_dtype, embed, hidden_size, lm_head, num_layers, vocab_size
from engines.static import Shape, StaticState, capacity_for


# Every config.json field this loader reads, with its type and range (engines/checkpoint.py);
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
    stable = False  # attend over the context cache's whole buffer (engines/dispatch.py; set per engine)

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

class DFlash(Engine):
    """Shared by Option A and Option C; they differ only in verify() and rollback()."""

    knobs = ("block_size", "drafter")
    drafter_kind = "dflash"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return tuple(read_drafter_config(Path(cfg.drafter))[0].target_layer_ids)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_drafter(cfg.drafter, target.model)
        self.block = cfg.block_size or self.drafter.config.block_size
        self.mask_id = self.drafter.config.mask_token_id
        self._check_hidden_layers(self.drafter.config.target_layer_ids)
        for layer in self.drafter.layers:
            layer.self_attn.stable = target.stable_attention

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.context = [hidden]  # [1, n, n*H] target hidden states not yet in the drafter's cache
        self.dcache = self.drafter.make_cache()
        return logits

    def prepare(self, history):
        # The prompt's context (projection and every drafter layer's K/V) before the first draft.
        with small_m_linears(self.target.small_m_gemm):
            self.drafter.feed_context(self.drafter.project_context(self._pending_context()), self.dcache)

    def _pending_context(self) -> mx.array:
        hidden = self.context[0] if len(self.context) == 1 else mx.concatenate(self.context, axis=1)
        self.context = []
        return hidden  # [1, S, n*H]

    def draft(self, history):
        k = self.block - 1
        ids = mx.array([[history[-1]] + [self.mask_id] * k], dtype=mx.int32)
        x = embed(self.target.model, ids)  # [1, K+1, H], the target's own embedding scale included
        if self.drafter.config.input_embedding_scale != 1.0:
            x = x * self.drafter.config.input_embedding_scale
        self.prof.mark("embed", x)
        with small_m_linears(self.target.small_m_gemm):  # the drafter's matmuls are over a few rows too
            if self.context:
                ctx = self.drafter.project_context(self._pending_context())  # [1, S, H]
            else:  # right after prepare(): the prompt's context is in the cache already
                ctx = mx.zeros((1, 0, x.shape[-1]), dtype=x.dtype)
            self.prof.mark("extract", ctx)
            h = self.drafter(x, ctx, self.dcache)[:, 1:]  # [1, K, H]
            self.prof.mark("drafter_fwd", h)
            logits = self.drafter.logits(lm_head(self.target.model, h, softcap=False))[0]  # [K, V]
        tokens, q = self.sampler.propose(logits, len(history) - self.prompt_len)  # [K] on the device
        self.prof.mark("drafter_argmax", tokens)
        return Draft(tokens, q)

    def caches(self):
        return [*super().caches(), *getattr(self, "dcache", [])]

    def verify(self, pending, draft):
        logits, self.verified = self.target_verify(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, n*H]
        return logits

    def rollback(self, n_accepted, draft):
        self.context.append(self.verified[:, : n_accepted + 1])  # [1, n+1, n*H] of the kept positions
        self._commit(n_accepted)

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "drafter_layers": c.num_hidden_layers, "target_layer_ids": list(c.target_layer_ids),
                "drafter_block_size": c.block_size, "block_size": self.block, "layer_types": list(c.layer_types),
                "sliding_window": c.sliding_window, "block_causal": [c.causal(i) for i in range(c.num_hidden_layers)],
                "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling}


class DFlashA(DFlash):
    """Option A: incremental verify at the end of the output, exact rollback."""

    name = "dflash_a"
    knobs = ("block_size", "drafter", "verify")

    def _commit(self, n_accepted):
        self.target.commit(n_accepted + 1)


class DFlashC(DFlash):
    """Option C: every round re-prefills prompt + output + block from position 0."""

    name = "dflash_c"
    incremental_verify = False  # the speedup model must take its verify cost from the profile

    def draft(self, history):
        self.sequence = history  # prompt + output, pending last
        return super().draft(history)

    def verify(self, pending, draft):
        self.target.prefill(self.sequence[:-1], reuse=False)  # the whole prefix, from position 0: Option C's cost
        logits, self.verified = self.target.forward(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, n*H]
        return logits

    def _commit(self, n_accepted):
        pass  # the next round rebuilds the cache from position 0


# ---------------------------------------------------------------- execution=static

def _static_block_mask(start: mx.array, kept: mx.array, S: int, L: int, C: int, window: int | None,
                       causal: bool) -> mx.array:
    """[L, C] which buffer slots each block row sees when [ctx (S rows, the first `kept` real); block (L)]
    was written at `start`: the context before the block (slots < start + kept, within `window`), and
    the block's own slots start + S.. (rows 0..i if causal); the rejected context rows between are not."""
    ctx_end = start + kept  # the block's first position: the context the drafter has seen ends there
    slot, row = mx.arange(C)[None], mx.arange(L)[:, None]  # [1, C], [L, 1]
    visible = slot < ctx_end
    if window:
        visible = visible & (ctx_end + row - slot < window)
    first = start + S  # the block's first slot
    block = (slot >= first) & (slot < first + L)
    if causal:
        block = block & (slot - first <= row)
    return visible | block


def _static_block_attention(attn: DFlashAttention, x: mx.array, ctx: mx.array, rope, cache, start: mx.array,
                            kept: mx.array, masks: dict) -> mx.array:
    """DFlashAttention._decode on a StaticKVCache at device position `start`, in fixed shapes: the K/V
    of all S context rows (the first `kept` real) and the L block rows are one write; the block's rope
    and mask place it right after the kept rows (position start + kept), as the eager cache would."""
    S, L = ctx.shape[1], x.shape[1]
    rows = mx.concatenate([ctx, x], axis=1)  # [1, S + L, H]
    k = attn._heads(attn.k_proj(rows), attn.n_kv, attn.k_norm)  # [1, Hkv, S + L, D]
    k = mx.concatenate([rope(k[:, :, :S], offset=start), rope(k[:, :, S:], offset=start + kept)], axis=2)
    keys, values = cache.update_and_fetch(k, attn._heads(attn.v_proj(rows), attn.n_kv))  # [1, Hkv, C, D]
    q = rope(attn._heads(attn.q_proj(x), attn.n_heads, attn.q_norm), offset=start + kept)  # [1, Hq, L, D]
    key = (attn.window, attn.causal)
    if key not in masks:  # layers alike share one mask per forward
        masks[key] = _static_block_mask(start, kept, S, L, keys.shape[2], attn.window, attn.causal)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=masks[key])
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))


class DFlashAStatic(DeviceEngine):
    """DFlash Option A in a round that stays on the device (engines/device.py).

    The drafter's context K/V live in StaticKVCaches of its own at a device position `dpos`: the
    number of target positions whose hidden states it has seen, which is the target position of the
    pending token. Each round feeds the previous verify's hidden states of all K + 1 verified
    positions (fixed shape; the first `kept` = n + 1 of them were accepted) together with the block
    [pending, mask x K] in one compiled drafter forward: their K/V are one write at dpos, the block's
    rope and mask place it at dpos + kept (the rejected rows between are masked, and overwritten by
    the next round's write), and the position then moves to dpos + kept. The block is always K + 1."""

    name = "dflash_a"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "dflash"
    fusable = True  # its state: engine attributes and a StaticState (DeviceEngine.next_round)

    @classmethod
    def hidden_layers(cls, cfg, model):
        return tuple(read_drafter_config(Path(cfg.drafter))[0].target_layer_ids)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_drafter(cfg.drafter, target.model)
        c = self.drafter.config
        self.block = cfg.block_size or c.block_size
        self.k = self.block - 1
        self._check_hidden_layers(c.target_layer_ids)
        self.masks = mx.full((self.k,), c.mask_token_id, dtype=mx.int32)  # [K]
        self.dstate = StaticState([Shape(layer.self_attn.n_kv, c.head_dim, layer.self_attn.window)
                                   for layer in self.drafter.layers], activation_dtype(target.model))
        self.drafter_traces = 0  # compiled traces of the drafter forward: one per capacity, never one per step
        self._draft = mx.compile(self._draft_logits, inputs=self.dstate.arrays, outputs=self.dstate.arrays)

    def start(self, prompt, max_new_tokens):
        # DeviceEngine.start, keeping the prompt's hidden states: the drafter's first context.
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        # dpos <= the target's position, and a round writes 2 (K + 1) rows past it
        self.dstate.reset(capacity_for(len(prompt) + max_new_tokens + 4 * self.block))
        ctx = self.drafter.project_context(fwd.hidden)  # [1, P, H]
        for layer, cache in zip(self.drafter.layers, self.dstate.caches):
            layer.self_attn.write_context(ctx, self.drafter._rope, cache)  # eager: P varies per prompt
        self.context = mx.zeros((1, self.block, fwd.hidden.shape[-1]), dtype=fwd.hidden.dtype)  # [1, K+1, n*H]
        self.kept = mx.array(0, dtype=mx.int32)  # none of those rows is real yet
        return self.pending

    def _draft_logits(self, block: mx.array, hidden: mx.array, kept: mx.array) -> mx.array:
        # block [K+1] ids, hidden [1, K+1, n*H] of the last verify (first `kept` real) -> logits [K, V].
        self.drafter_traces += 1  # runs only while mx.compile traces
        d, c = self.drafter, self.drafter.config
        x = embed(self.target.model, block[None])  # [1, K+1, H]
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        ctx = d.project_context(hidden)  # [1, K+1, H]
        start, masks = self.dstate.position, {}
        h = x
        for layer, cache in zip(d.layers, self.dstate.caches):
            h = h + _static_block_attention(layer.self_attn, layer.input_layernorm(h), ctx, d._rope, cache, start,
                                            kept, masks)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.dstate.set_position(start + kept)  # the accepted context stays; the block was written to be attended
        h = d.norm(h)[:, 1:]  # [1, K, H]
        return d.logits(lm_head(self.target.model, h, softcap=False))[0]

    def round(self):
        logits = self._draft(mx.concatenate([self.pending, self.masks]), self.context, self.kept)  # [K, V]
        drafts, q = self.sampler.propose(logits, self.out_pos)  # [K], [K, V] or None
        outcome, fwd = self.verify_and_accept(drafts.astype(mx.int32), q)
        self.context, self.kept = fwd.hidden, outcome[0] + 1  # read by the next round's drafter forward
        return outcome

    def caches(self):
        return [*super().caches(), *self.dstate.caches]

    def state(self):
        return [*super().state(), self.dstate.arrays, self.context, self.kept]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "k": self.k, "block_size": self.block, "drafter_layers": c.num_hidden_layers,
                "target_layer_ids": list(c.target_layer_ids), "drafter_traces": self.drafter_traces}
