"""EAGLE-3 training: the training-time test (TTT) over the engine's own Eagle3Drafter.

Position i of a row pairs the fused target features at i with token i+1 and predicts token
i+2; step k of the unroll feeds each position the drafter's own output from step k-1 and
the ground-truth token i+k+1, predicting i+k+2 (SafeAILab / SpecForge teacher forcing). A
query of step k sees step 0's keys causally (positions <= i) and, of every later step j <= k,
only its own position's key: what the drafter's cache holds at inference when it chains k
steps past position i. Step k's loss is the soft cross-entropy against the target's
distribution over the draft vocabulary (renormalised), weighted decay**k, on answer
positions whose target argmax the draft vocabulary covers.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx

from engines.drafters.eagle3 import Eagle3Config, Eagle3Drafter, default_aux_layers, load_eagle3, save_eagle3
from engines.runtime.hidden import embed, num_layers
from train.objective import Objective, layer_ids_within, pad, shift, soft_ce, target_head_rows, weighted_mean


def draft_vocab(rows: list[list[int]], prompt_lens: list[int], vocab: int, size: int) -> mx.array:
    """The `size` most frequent answer tokens (ties: lower id), padded with the lowest unseen
    ids, sorted ascending: draft id i is target id used[i] (d2t[i] = used[i] - i)."""
    counts: dict[int, int] = {}
    for r, p in zip(rows, prompt_lens):
        for t in r[p:]:
            counts[t] = counts.get(t, 0) + 1
    size = min(size, vocab)
    used = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    seen = set(used)
    used += [t for t in range(vocab) if t not in seen][: size - len(used)]
    return mx.array(sorted(used), dtype=mx.int32)


def distinct_aux_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high layer inputs, made distinct on shallow targets (the loader
    refuses repeats): 2, n//2, n-3 where they differ, else the first free ids in 1..n."""
    ids = list(dict.fromkeys(default_aux_layers(n_layers)))
    ids += [i for i in range(1, n_layers + 1) if i not in ids][: 3 - len(ids)]
    return tuple(sorted(ids))


def aux_layers_within(ids, n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's aux ids name layer *inputs*: 1..n (layer i's input is layer i-1's output; n, the last
    layer's output), as the engine's loader reads them; ConfigError naming train.aux_layer_ids otherwise."""
    return tuple(sorted(layer_ids_within(ids, 1, n_layers, "train.aux_layer_ids")))


class Eagle3Objective(Objective):
    kind = "eagle3"

    @classmethod
    def check(cls, target, cfg) -> None:
        if cfg.aux_layer_ids:
            aux_layers_within(cfg.aux_layer_ids, num_layers(target))

    def __init__(self, target, tokenizer, cfg, rows, prompt_lens, shape: Eagle3Config | None = None):
        """`shape`: the drafter's config as given (a published or fixture config: its aux layers and
        draft vocabulary size); null = derived from the target and cfg."""
        super().__init__(target, tokenizer, cfg)
        self.positions = cfg.ttt_length
        size = shape.draft_vocab_size if shape else cfg.draft_vocab_size
        self._use_vocab(draft_vocab(rows, prompt_lens, self.vocab, size))
        c = shape or self._derived_shape(cfg)
        self.aux = aux_layers_within(c.aux_layer_ids, self.n_layers)  # layer inputs
        mx.random.seed(cfg.seed)
        d = Eagle3Drafter(c)
        d.set_dtype(mx.float32)
        d.d2t = (self.used - mx.arange(self.used.size)).astype(mx.int64)
        if cfg.init_lm_head_from_target:
            d.lm_head.weight = target_head_rows(target, self.used)
        d.freeze(keys=["d2t"], recurse=False)
        self.module = d

    def adopt(self, theirs: dict) -> None:
        """A warm start keeps its drafter's draft vocabulary (made from the data it first trained
        on): answers' tokens outside it weigh nothing, as tokens outside any draft vocabulary do."""
        d2t = theirs.get("d2t")
        if d2t is None or d2t.shape != self.module.d2t.shape:
            return  # warm_start names the difference
        self._use_vocab((d2t + mx.arange(d2t.size)).astype(self.used.dtype))
        self.module.d2t = d2t.astype(mx.int64)

    def _use_vocab(self, used: mx.array) -> None:
        """Draft with the target ids `used` ([Vd], increasing); in_draft marks them in the target vocab."""
        self.used = used
        self.in_draft = mx.zeros((self.vocab,), dtype=mx.bool_).at[used].add(True)

    def _derived_shape(self, cfg) -> Eagle3Config:
        aux = cfg.aux_layer_ids or distinct_aux_layers(self.n_layers)
        return Eagle3Config(hidden_size=self.hidden, num_attention_heads=self.args.num_attention_heads,
                            num_key_value_heads=self.arg("num_key_value_heads", self.args.num_attention_heads),
                            intermediate_size=cfg.intermediate_size or self.args.intermediate_size,
                            rms_norm_eps=self.args.rms_norm_eps,
                            max_position_embeddings=self.arg("max_position_embeddings", 4096),
                            vocab_size=self.vocab, draft_vocab_size=int(self.used.size),
                            target_hidden_size=self.hidden, head_dim=self.head_dim(),
                            rope_theta=float(self.arg("rope_theta", 10000.0)), rope_scaling=self.arg("rope_scaling"),
                            norm_before_residual=True, qk_norm=False, layer_types=("full_attention",),
                            aux_layer_ids=tuple(sorted(aux)))  # checked by __init__

    def batch(self, rows, prompt_lens, rng: random.Random) -> dict:
        ids, ans = pad(rows, prompt_lens)
        feats, logits = self.capture(ids, tuple(i - 1 for i in self.aux))  # layer i's input = layer i-1's output
        teacher = mx.softmax(logits[..., self.used], axis=-1)  # [B, T, Vd]: L_t, renormalised on the draft vocab
        covered = self.in_draft[mx.argmax(logits, axis=-1)].astype(mx.float32)  # [B, T]
        return {"ids": ids, "ans": ans, "feats": mx.concatenate(feats, axis=-1), "teacher": teacher,
                "covered": covered}

    def loss(self, d: Eagle3Drafter, b: dict):
        ids, ans = b["ids"], b["ans"]
        h = d.fuse(b["feats"])  # [B, T, H]: step 0's input at position i is the feature at i
        keys, values, total, accs, norm = [], [], 0.0, [], 0.0
        for k in range(self.cfg.ttt_length):
            tokens = shift(ids, k + 1)  # token i+k+1
            teacher = shift(b["teacher"], k + 1)  # L_{i+k+1}: the distribution of token i+k+2
            w = shift(ans, k + 2) * shift(b["covered"], k + 1)  # token i+k+2 is an answer token the vocab covers
            h = ttt_step(d, embed(self.target, tokens).astype(mx.float32), h, keys, values, k)
            logq = d.logprobs(h)  # [B, T, Vd]
            total = total + self.cfg.ploss_decay ** k * weighted_mean(soft_ce(logq, teacher), w)
            norm += self.cfg.ploss_decay ** k
            accs.append(weighted_mean((mx.argmax(logq, -1) == mx.argmax(teacher, -1)).astype(mx.float32), w))
            h = d.next_feature(h)
        return total / norm, {"acc": mx.stack(accs), "n": ans.sum()}

    def export(self, module, out: Path, dtype) -> None:
        save_eagle3(module, out, dtype)

    def load(self, out: Path):
        return load_eagle3(out, self.target)

    def describe(self) -> dict:
        return {"aux_layer_ids": list(self.aux), "draft_vocab_size": int(self.used.size),
                "ttt_length": self.cfg.ttt_length}


def ttt_step(d: Eagle3Drafter, emb: mx.array, h_in: mx.array, keys: list, values: list, k: int) -> mx.array:
    """Unrolled step k of the drafter's (one) decoder layer over whole rows: [B, T, H] -> [B, T, H].
    keys/values hold steps 0..k-1 and get step k's."""
    assert len(d.layers) == 1, "the TTT unroll covers EAGLE-3's single decoder layer"
    layer, attn = d.layers[0], d.layers[0].self_attn
    g = layer.hidden_norm(h_in)
    x = mx.concatenate([layer.input_layernorm(emb), g], axis=-1)  # [B, T, 2H]
    residual = g if layer.norm_before_residual else h_in
    B, T, _ = x.shape
    q = attn.rope(attn._heads(attn.q_proj(x), attn.n_heads, getattr(attn, "q_norm", None)), offset=k)
    keys.append(attn.rope(attn._heads(attn.k_proj(x), attn.n_kv, getattr(attn, "k_norm", None)), offset=k))
    values.append(attn._heads(attn.v_proj(x), attn.n_kv))  # [B, n_kv, T, D]
    rep = attn.n_heads // attn.n_kv
    wide = lambda t: mx.repeat(t, rep, axis=1) if rep > 1 else t  # [B, n_heads, T, D]
    causal = mx.arange(T)[None] <= mx.arange(T)[:, None]  # [T, T]
    s0 = mx.where(causal, (q @ wide(keys[0]).transpose(0, 1, 3, 2)) * attn.scale, -1e9)  # [B, h, T, T]
    diag = [(q * wide(kj)).sum(-1, keepdims=True) * attn.scale for kj in keys[1:]]  # [B, h, T, 1] each
    p = mx.softmax(mx.concatenate([s0, *diag], axis=-1), axis=-1, precise=True)
    out = p[..., :T] @ wide(values[0])
    for j, vj in enumerate(values[1:]):
        out = out + p[..., T + j: T + j + 1] * wide(vj)
    h = residual + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))
