"""EAGLE-3: a one-layer drafter on fused low/mid/high target features, with a dynamic
draft tree verified in one target forward (arXiv 2503.01840; EAGLE-2 tree policy).

Drafter step at position t (the pair: feature for t, token t+1):
    g_t = fc([f_low ; f_mid ; f_high])          # target layer inputs, 3 * H_target -> H
    x = [input_layernorm(embed(tok_{t+1})) ; hidden_norm(g_t)]     # 2H, into q/k/v
    h = residual + attn(x)  (residual = g_t, or hidden_norm(g_t) if norm_before_residual)
    h = h + mlp(post_attention_layernorm(h))     # h feeds the next step as its feature
    logits over the draft vocabulary = lm_head(norm(h)); target id = draft id + d2t[id]

Tree (EAGLE-2): from the pending token, take the top_k children; for depth-1 more
steps expand the top_k best nodes by cumulative log-probability (each node attends
to the committed context, its ancestors and itself); keep the `total_tokens` best
nodes. The target verifies the tree in one forward with a tree mask and per-node
positions (engines/tree.py), the longest path matching the target's greedy choices
is accepted, and the target cache is compacted to that path.

Hybrid (DeltaNet) targets cannot verify a tree (one recurrent state, many branches),
and the tree form of speculative sampling is not implemented: in both cases the
engine drafts and verifies the single best chain (greedy, or sampled with q and
speculative sampling), with exact rollback. Every record says which path ran.

Checkpoint layouts: `speculators` (config with transformer_layer_config,
draft_vocab_size, target_hidden_size, norm_before_residual,
eagle_aux_hidden_state_layer_ids; weights layers.0.*) and SafeAILab's EAGLE-3
(Llama-style config with draft_vocab_size; weights midlayer.*).
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

from engines.base import Draft, DrafterError, Engine, register
from engines.cache import trim_attention
from engines.checkpoint import check_tensors, read_config, read_tensors, write_checkpoint
from engines.hidden import activation_dtype, embed, hidden_size, num_layers, vocab_size

LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
              "max_position_embeddings", "vocab_size")


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_before_residual: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    layout: str = "speculators"

    @classmethod
    def from_json(cls, cfg: dict, where: str) -> "Eagle3Config":
        layout = "speculators" if "transformer_layer_config" in cfg else "eagle"
        layer = cfg.get("transformer_layer_config", cfg)
        missing = [k for k in LAYER_KEYS if k not in layer]
        if missing:
            raise DrafterError(f"{where}: missing {', '.join(missing)} (an EAGLE-3 config has them)")
        h = layer["hidden_size"]
        aux = cfg.get("eagle_aux_hidden_state_layer_ids")
        return cls(**{k: layer[k] for k in LAYER_KEYS},
                   draft_vocab_size=cfg.get("draft_vocab_size", layer["vocab_size"]),
                   target_hidden_size=cfg.get("target_hidden_size") or h,
                   head_dim=layer.get("head_dim") or h // layer["num_attention_heads"],
                   rope_theta=layer.get("rope_theta", 10000.0), rope_scaling=layer.get("rope_scaling"),
                   norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                   aux_layer_ids=tuple(aux) if aux else None, layout=layout)

    def to_json(self) -> dict:
        layer = {k: getattr(self, k) for k in LAYER_KEYS}
        layer.update(model_type="llama", head_dim=self.head_dim, rope_theta=self.rope_theta)
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size, "norm_before_residual": self.norm_before_residual,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids or ())}


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """Low / mid / high as the EAGLE-3 reference picks them (inputs of these layers)."""
    return max(1, min(2, n_layers - 1)), max(1, n_layers // 2), max(1, n_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.n_heads, self.n_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, c.hidden_size, bias=False)
        self.rope = initialize_rope(d, base=c.rope_theta, traditional=False, scaling_config=c.rope_scaling,
                                    max_position_embeddings=c.max_position_embeddings)

    def _heads(self, x, n):
        return x.reshape(*x.shape[:2], n, -1).transpose(0, 2, 1, 3)  # [B, T, n*D] -> [B, n, T, D]

    def __call__(self, x, cache: KVCache | None, offset, mask=None):
        """x [B, T, 2H], appended to `cache` (if any). With `mask` None the T tokens are
        consecutive positions from `offset` (causal). Otherwise they are tree nodes that all
        sit at position `offset` and see the cache's entries under mask [T, C + T]."""
        B, T, _ = x.shape
        q, k, v = self._heads(self.q_proj(x), self.n_heads), self._heads(self.k_proj(x), self.n_kv), \
            self._heads(self.v_proj(x), self.n_kv)
        if mask is None:
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
            mask = "causal" if T > 1 else None
        else:  # one position for every node: rotate them as a batch of length-1 sequences
            rot = lambda t: self.rope(t.transpose(2, 1, 0, 3), offset=offset).transpose(2, 1, 0, 3)
            q, k = rot(q), rot(k)
        keys, values = cache.update_and_fetch(k, v) if cache is not None else (k, v)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h = c.hidden_size
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.mlp = MLP(h, c.intermediate_size)  # SwiGLU gate/up/down, as in Llama

    def __call__(self, embeds, feats, cache, offset, mask=None):
        g = self.hidden_norm(feats)
        x = mx.concatenate([self.input_layernorm(embeds), g], axis=-1)
        h = (g if self.norm_before_residual else feats) + self.self_attn(x, cache, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = [Eagle3Layer(c)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((c.draft_vocab_size,), dtype=mx.int64)

    def step(self, embeds, feats, cache, offset, mask=None):
        """One drafter step: [1, T, H] embeddings and features -> [1, T, H] output features."""
        return self.layers[0](embeds, feats, cache, offset, mask)

    def logprobs(self, h: mx.array) -> mx.array:
        """[..., H] -> log-probabilities over the draft vocabulary [..., Vd]."""
        return nn.log_softmax(self.lm_head(self.norm(h)).astype(mx.float32), axis=-1)

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids + self.d2t[draft_ids]


def save_eagle3(drafter: Eagle3Drafter, path: Path, dtype=mx.bfloat16) -> None:
    """Write `drafter` in the speculators layout (t2d: which target ids the draft vocabulary covers)."""
    t2d = mx.zeros((drafter.config.vocab_size,), dtype=mx.bool_)
    t2d[drafter.to_target(mx.arange(drafter.config.draft_vocab_size))] = True
    write_checkpoint(path, drafter.config.to_json(), {**dict(tree_flatten(drafter.parameters())), "t2d": t2d}, dtype)


def load_eagle3(path: Path, target: nn.Module) -> Eagle3Drafter:
    """Load and validate an EAGLE-3 drafter (speculators or SafeAILab layout); DrafterError on any mismatch."""
    path = Path(path)
    c = Eagle3Config.from_json(read_config(path, "an EAGLE-3 drafter"), str(path / "config.json"))
    n, h, vocab = num_layers(target), hidden_size(target), vocab_size(target)
    if c.aux_layer_ids is None:
        c.aux_layer_ids = default_aux_layers(n)
    if len(c.aux_layer_ids) != 3 or not all(1 <= i <= n for i in c.aux_layer_ids):
        raise DrafterError(f"eagle_aux_hidden_state_layer_ids {list(c.aux_layer_ids)} must be 3 layer ids in 1..{n} "
                           "(layer i's input = the output of layer i-1)")
    if c.target_hidden_size != h:
        raise DrafterError(f"target_hidden_size {c.target_hidden_size} != target hidden size {h}")
    if c.hidden_size != h:
        raise DrafterError(f"drafter hidden_size {c.hidden_size} != target hidden size {h}: the drafter reads "
                           "the target's token embeddings")
    if c.vocab_size != vocab:
        raise DrafterError(f"drafter vocab_size {c.vocab_size} != target vocab size {vocab}")
    def rename(k):  # SafeAILab's midlayer.* is the speculators layers.0.*
        k = k.removeprefix("model.")
        return "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k

    weights = read_tensors(path, rename)
    drafter = Eagle3Drafter(c)
    check_tensors(weights, {k: v.shape for k, v in tree_flatten(drafter.parameters())}, "EAGLE-3", path)
    d2t = weights["d2t"].astype(mx.int64)
    targets = mx.arange(c.draft_vocab_size) + d2t
    if mx.any((targets < 0) | (targets >= vocab)).item():
        raise DrafterError(f"d2t maps draft ids outside the target vocab (0..{vocab - 1})")
    dtype = activation_dtype(target)
    drafter.load_weights([(k, d2t if k == "d2t" else weights[k].astype(dtype))
                          for k, _ in tree_flatten(drafter.parameters())])
    drafter.eval()
    mx.eval(drafter.parameters())
    return drafter


# ---------------------------------------------------------------- the engine

@dataclass
class _Node:
    parent: int  # node index, -1 = root (the pending token)
    score: float  # cumulative log-probability
    depth: int
    feature: mx.array | None = None  # [1, 1, H] the drafter output after this node was processed
    kv_slot: int = -1  # which tree entry of the drafter cache this node owns once expanded


@register("eagle3")
class Eagle3(Engine):
    knobs = ("drafter", "verify", "depth", "top_k", "total_tokens")
    drafter_kind = "eagle3"

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_eagle3(Path(cfg.drafter), target.model)
        self.depth, self.top_k, self.total = cfg.depth, cfg.top_k, cfg.total_tokens
        aux = self.drafter.config.aux_layer_ids
        target.hidden_layers = tuple(i - 1 for i in aux)  # input of layer i = output of layer i - 1
        self.hybrid = target.layout.recurrent > 0  # one recurrent state cannot serve several branches
        self.draft_ids = self.drafter.to_target(mx.arange(self.drafter.config.draft_vocab_size))  # [Vd] target ids
        self.block = (self.depth if self.hybrid else self.total) + 1  # tokens a full verify feeds

    @property
    def tree_mode(self) -> bool:
        sampling = self.sampler is not None and self.sampler.temperature > 0
        return not (self.hybrid or sampling)

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits = self.target.prefill(prompt)
        self.features = [self.target.hidden]  # [1, n, 3H] target features not yet in the drafter cache
        self.cache = KVCache()
        return logits

    def _commit_pass(self, history) -> mx.array:
        """Feed the newly verified positions (feature t, token t+1) into the drafter cache;
        returns the last output feature [1, 1, H] (it predicts the token after pending)."""
        feats = self.features[0] if len(self.features) == 1 else mx.concatenate(self.features, axis=1)
        self.features = []
        start = self.cache.offset
        e = embed(self.target.model, mx.array([history[start + 1:]], dtype=mx.int32))
        return self.drafter.step(e, self.drafter.fc(feats), self.cache, start)[:, -1:]

    def draft(self, history):
        depth = self.depth
        root = self._commit_pass(history)
        self.prof.mark("commit_pass", root)
        committed = self.cache.offset
        draft = (self._tree if self.tree_mode else self._chain)(history, root, depth)
        trim_attention(self.cache, self.cache.offset - committed)  # tree/chain entries were drafts
        self.prof.mark("tree_expand", draft.tokens)
        return draft

    def _expand(self, nodes: list[_Node], frontier: list[int], tokens: mx.array, pos: int, n_prev: int) -> mx.array:
        """One drafter step for the frontier nodes, all at position `pos`, their K/V appended to
        the drafter cache after the n_prev tree entries already there; [1, F, H]."""
        F = len(frontier)
        e = embed(self.target.model, mx.take(tokens, mx.array(frontier))[None])  # [1, F, H]
        feats = mx.concatenate([nodes[nodes[f].parent].feature if nodes[f].parent >= 0 else self._root
                                for f in frontier], axis=1)
        tree = [[False] * n_prev for _ in frontier]
        for row, f in zip(tree, frontier):  # each node sees its ancestors' entries (one walk per node)
            p = nodes[f].parent
            while p >= 0:
                row[nodes[p].kv_slot] = True
                p = nodes[p].parent
        context = self.cache.offset - n_prev
        mask = mx.concatenate([mx.ones((F, context), dtype=mx.bool_), mx.array(tree, dtype=mx.bool_).reshape(F, n_prev),
                               mx.eye(F, dtype=mx.bool_)], axis=1)  # [F, C + n_prev + F]
        out = self.drafter.step(e, feats, self.cache, pos, mask=mask)
        for j, f in enumerate(frontier):
            nodes[f].feature, nodes[f].kv_slot = out[:, j:j + 1], n_prev + j
        return out

    def _tree(self, history, root, depth) -> Draft:
        self._root = root
        pending_pos = len(history) - 1
        lp = self.drafter.logprobs(root[0, 0])  # [Vd]
        top = mx.argsort(-lp)[: self.top_k]
        ids = [self.drafter.to_target(top)]  # node i's target id is concat(ids)[i]; ids stay on the device
        nodes = [_Node(-1, s, 1) for s in lp[top].tolist()]
        frontier, n_prev = list(range(len(nodes))), 0
        for d in range(2, depth + 1):
            out = self._expand(nodes, frontier, mx.concatenate(ids), pending_pos + d - 2, n_prev)  # [1, F, H]
            n_prev += len(frontier)
            lp = self.drafter.logprobs(out[0])  # [F, Vd]
            top = mx.argsort(-lp, axis=-1)[:, : self.top_k]  # [F, k]
            scores = mx.take_along_axis(lp, top, axis=-1) + mx.array([nodes[f].score for f in frontier])[:, None]
            ids.append(self.drafter.to_target(top).reshape(-1))
            first = len(nodes)
            for f, row in zip(frontier, scores.tolist()):  # the depth's one host read
                nodes += [_Node(f, s, d) for s in row]
            new = sorted(range(first, len(nodes)), key=lambda i: (-nodes[i].score, i))
            frontier = sorted(new[: self.top_k])
        keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[: self.total])
        keep = self._close_under_ancestors(nodes, keep)
        index = {old: new for new, old in enumerate(keep)}
        return Draft(mx.take(mx.concatenate(ids), mx.array(keep)),
                     parents=[index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep])

    @staticmethod
    def _close_under_ancestors(nodes, keep):
        out = set(keep)
        for i in keep:
            p = nodes[i].parent
            while p >= 0 and p not in out:
                out.add(p)
                p = nodes[p].parent
        return sorted(out)

    def _chain(self, history, root, depth) -> Draft:
        """The single best (or sampled) path, for hybrid targets and temperature > 0: causal
        drafter steps at consecutive positions, every token kept on the device."""
        pending_pos = len(history) - 1
        pos_out = len(history) - self.prompt_len
        sampling = self.sampler is not None and self.sampler.temperature > 0
        tokens, qs, h = [], [], root
        for d in range(1, depth + 1):
            if d > 1:  # the previous draft with the feature that predicted it, at its parent's position
                h = self.drafter.step(embed(self.target.model, tokens[-1][None]), h, self.cache, pending_pos + d - 2)
            logits = self.drafter.lm_head(self.drafter.norm(h[0, -1]))[None]  # [1, Vd]
            pick, q_draft = self.sampler.propose(logits, pos_out + d - 1)
            if sampling:  # q over the target vocabulary, for speculative sampling
                qs.append(mx.zeros((1, self.drafter.config.vocab_size)).at[:, self.draft_ids].add(q_draft))
            tokens.append(self.drafter.to_target(pick))
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs else None)

    def verify(self, pending, draft):
        tokens = mx.concatenate([pending, draft.tokens])
        if draft.parents is not None:
            logits = self.target.verify_tree(tokens, draft.parents)
        else:
            logits = self.target_verify(tokens)
        self.verified_features = self.target.hidden
        return logits

    def rollback(self, n_accepted, draft):
        if draft.parents is not None:
            keep = [0, *(i + 1 for i in draft.accepted_path)]
            self.target.commit_tree(keep)
            self.features.append(self.verified_features[:, mx.array(keep)])
        else:
            self.target.commit(n_accepted + 1)
            self.features.append(self.verified_features[:, : n_accepted + 1])

    def caches(self):
        return [*super().caches(), *([self.cache] if hasattr(self, "cache") else [])]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(),
                "tree_path": "chain (hybrid target)" if self.hybrid else "tree (greedy); chain when sampling",
                "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total, "aux_layer_ids": list(c.aux_layer_ids),
                "draft_vocab_size": c.draft_vocab_size, "layout": c.layout}
