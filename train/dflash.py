"""DFlash training: the block-diffusion objective over the engine's own DFlashDrafter.

Per row, up to train.num_anchors anchors a are drawn among answer positions (a and a+1 both
answer tokens, a >= 1). Block a is [x_a, mask x (B-1)] at positions a..a+B-1; its queries see
the projected target features strictly before a and every key of their own block
(bidirectional, as z-lab's full-attention drafter layers decode), never another block.
Block position k >= 1 is labelled with the data token x_{a+k} (the target's own answer) and
weighted exp(-(k-1)/gamma) (SpecForge's recipe; z-lab publishes inference only).
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engines.drafters.dflash import DFlashConfig, DFlashDrafter, load_drafter, save_drafter
from engines.runtime.hidden import embed, lm_head, num_layers, vocab_size
from harness.errors import ConfigError
from train.objective import Objective, layer_ids_within, pad, weighted_mean


def spread_layer_ids(n_target: int, n: int) -> list[int]:
    """n target layer ids spread evenly over 1..n_target-3 (z-lab's build_target_layer_ids)."""
    if n == 1:
        return [n_target // 2]
    lo, hi = 1, max(1, n_target - 3)
    return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})


def pick_mask_token(tokenizer, vocab: int) -> int:
    """A row of the target's embedding no text uses where there is one (the first id past the
    tokenizer's), else the tokenizer's unk / pad token, else 0."""
    n = len(tokenizer._tokenizer) if hasattr(tokenizer, "_tokenizer") else vocab
    if n < vocab:
        return n
    for name in ("unk_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int) and 0 <= value < vocab:
            return value
    return 0


def mask_id_within(mask_id: int, vocab: int) -> int:
    """`mask_id` when the target's embedding has that row; ConfigError naming train.mask_token_id
    otherwise (a lookup past the table is a segfault, not an error)."""
    if not 0 <= mask_id < vocab:
        raise ConfigError(f"train.mask_token_id={mask_id} is outside the target's vocabulary [0, {vocab}); "
                          "leave it null (an id the tokenizer does not use is picked) or give one below "
                          f"{vocab}")
    return mask_id


class DFlashObjective(Objective):
    kind = "dflash"

    @classmethod
    def check(cls, target, cfg) -> None:
        if cfg.target_layer_ids:
            layer_ids_within(cfg.target_layer_ids, 0, num_layers(target) - 1, "train.target_layer_ids")
        if cfg.mask_token_id is not None:
            mask_id_within(cfg.mask_token_id, vocab_size(target))

    def __init__(self, target, tokenizer, cfg, rows, prompt_lens, shape: DFlashConfig | None = None):
        """`shape`: the drafter's config as given (a published or fixture config); null = derived
        from the target and cfg (train.num_layers, block_size, target_layer_ids, ...)."""
        super().__init__(target, tokenizer, cfg)
        c = shape or self._derived_shape(tokenizer, cfg)
        self.layer_ids = layer_ids_within(c.target_layer_ids, 0, self.n_layers - 1, "train.target_layer_ids")
        self.block = c.block_size
        self.positions = self.block - 1
        mx.random.seed(cfg.seed)
        self.module = DFlashDrafter(c)
        self.module.set_dtype(mx.float32)
        L = self.block
        decay = [0.0] + [1.0 if cfg.loss_decay_gamma is None else float(mx.exp(mx.array(-(k - 1) / cfg.loss_decay_gamma)))
                         for k in range(1, L)]
        self.decay = mx.array(decay)  # [L]: position 0 (the anchor, given) is never a label

    def _derived_shape(self, tokenizer, cfg) -> DFlashConfig:
        # checked by __init__
        layer_ids = cfg.target_layer_ids or spread_layer_ids(self.n_layers, cfg.num_target_features)
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token(tokenizer, self.vocab)
        mask_id_within(mask_id, self.vocab)
        return DFlashConfig(hidden_size=self.hidden, num_hidden_layers=cfg.num_layers,
                            num_attention_heads=self.args.num_attention_heads,
                            num_key_value_heads=self.arg("num_key_value_heads", self.args.num_attention_heads),
                            head_dim=self.head_dim(),
                            intermediate_size=cfg.intermediate_size or self.args.intermediate_size,
                            rms_norm_eps=self.args.rms_norm_eps,
                            max_position_embeddings=self.arg("max_position_embeddings", 4096),
                            block_size=cfg.block_size, target_layer_ids=tuple(layer_ids), mask_token_id=mask_id,
                            rope_theta=float(self.arg("rope_theta", 10000.0)), rope_scaling=self.arg("rope_scaling"),
                            layer_types=("full_attention",) * cfg.num_layers, num_target_layers=self.n_layers,
                            vocab_size=self.vocab)

    def batch(self, rows, prompt_lens, rng: random.Random) -> dict:
        ids, ans = pad(rows, prompt_lens)
        feats, logits = self.capture(ids, self.layer_ids)
        said = ids  # position t's label: the row's token, or (labels=target) the target's choice after ids[:t]
        if self.cfg.labels == "target":
            said = mx.concatenate([ids[:, :1], mx.argmax(logits[:, :-1], axis=-1).astype(ids.dtype)], axis=1)
        A, L = self.cfg.num_anchors, self.block
        anchors, live = [], []
        for r, p in zip(rows, prompt_lens):
            valid = list(range(max(p, 1), len(r) - 1))  # x_a and x_{a+1} are answer tokens, and a has context
            if len(valid) >= A:
                pick = sorted(rng.sample(valid, A))
            else:  # every valid anchor once, then weightless repeats to fill the row's A slots
                pick = valid + [valid[0] if valid else 0] * (A - len(valid))
            anchors.append(pick)
            live.append([1.0] * min(A, len(valid)) + [0.0] * max(0, A - len(valid)))
        anchors = mx.array(anchors, dtype=mx.int32)  # [B, A]
        offs = anchors[..., None] + mx.arange(L)  # [B, A, L]
        T = ids.shape[1]
        inside = (offs < T).astype(mx.float32)
        flat = mx.minimum(offs, T - 1).reshape(ids.shape[0], -1)
        labels = mx.take_along_axis(said, flat, axis=1).reshape(offs.shape)  # x_{a+k}
        weight = inside * mx.take_along_axis(ans, flat, axis=1).reshape(offs.shape) * mx.array(live)[..., None]
        anchor = mx.take_along_axis(ids, flat, axis=1).reshape(offs.shape)  # the block's first token: the row's own
        tokens = mx.where(mx.arange(L) == 0, anchor, self.module.config.mask_token_id)
        return {"feats": mx.concatenate(feats, axis=-1), "anchors": anchors, "tokens": tokens, "labels": labels,
                "weight": weight * self.decay, "counted": weight}

    def loss(self, d: DFlashDrafter, b: dict):
        B, A, L = b["tokens"].shape
        x = embed(self.target, b["tokens"].reshape(B, A * L)).astype(mx.float32)  # [B, A*L, H]
        ctx = d.project_context(b["feats"])  # [B, T, H]
        for layer in d.layers:
            x = x + block_attention(layer.self_attn, layer.input_layernorm(x), ctx, d._rope, b["anchors"])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = d.logits(lm_head(self.target, d.norm(x), softcap=False)).reshape(B, A, L, -1)
        ce = nn.losses.cross_entropy(logits, b["labels"], reduction="none")  # [B, A, L]
        hit = (mx.argmax(logits, -1) == b["labels"]).astype(mx.float32)
        counted = b["counted"]
        acc = (hit * counted).sum(axis=(0, 1))[1:] / mx.maximum(counted.sum(axis=(0, 1))[1:], 1e-9)  # [L-1]
        return weighted_mean(ce, b["weight"]), {"acc": acc, "n": counted[..., 1:].sum()}

    def export(self, module, out: Path, dtype) -> None:
        save_drafter(module, out, dtype)

    def load(self, out: Path):
        return load_drafter(out, self.target)

    def describe(self) -> dict:
        c = self.module.config
        return {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": c.mask_token_id,
                "block_size": c.block_size, "num_layers": c.num_hidden_layers}


def block_attention(attn, x: mx.array, ctx: mx.array, rope, anchors: mx.array) -> mx.array:
    """Attention of A blocks per row at once: x [B, A*L, H] (block a at positions
    anchors[:, a]..+L-1), ctx [B, T, H] -> [B, A*L, H]. Block a sees context before its anchor
    and its own block (causally if the layer is causal), nothing else."""
    B, AL, _ = x.shape
    A = anchors.shape[1]
    L = AL // A

    def rope_blocks(t):  # [B, n, A*L, D] rotated at each block's own positions
        n, D = t.shape[1], t.shape[-1]
        t = t.reshape(B, n, A, L, D).transpose(0, 2, 1, 3, 4).reshape(B * A, n, L, D)
        t = rope(t, offset=anchors.reshape(-1))
        return t.reshape(B, A, n, L, D).transpose(0, 2, 1, 3, 4).reshape(B, n, AL, D)

    keys = rope(attn._heads(attn.k_proj(ctx), attn.n_kv, attn.k_norm), offset=0)  # [B, n_kv, T, D]
    values = attn._heads(attn.v_proj(ctx), attn.n_kv)
    q = rope_blocks(attn._heads(attn.q_proj(x), attn.n_heads, attn.q_norm))
    bk = rope_blocks(attn._heads(attn.k_proj(x), attn.n_kv, attn.k_norm))
    bv = attn._heads(attn.v_proj(x), attn.n_kv)
    T = ctx.shape[1]
    anchor_of = mx.repeat(anchors, L, axis=1)[:, :, None]  # [B, A*L, 1]
    visible = mx.arange(T)[None, None] < anchor_of  # [B, A*L, T]
    blk = mx.arange(AL) // L
    same = blk[:, None] == blk[None]  # [A*L, A*L]
    if attn.causal:
        same = same & (mx.arange(AL)[None] <= mx.arange(AL)[:, None])
    mask = mx.concatenate([visible, mx.broadcast_to(same, (B, AL, AL))], axis=-1)[:, None]  # [B, 1, A*L, T+A*L]
    out = mx.fast.scaled_dot_product_attention(q, mx.concatenate([keys, bk], axis=2),
                                               mx.concatenate([values, bv], axis=2), scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, AL, -1))
