"""EAGLE-3: a drafter on fused target features, with a dynamic draft tree verified in one
target forward (arXiv 2503.01840; EAGLE-2 tree policy).

Drafter step at position t (the pair: feature for t, token t+1):
    g_t = fc([f_1 ; ... ; f_A])             # inputs of the A aux target layers, A * H_target -> H
                                            # (norm_before_fc: one RMSNorm over the concatenation
                                            #  first; fc_norm: one RMSNorm per feature)
    layer 0: x = [input_layernorm(embed(tok_{t+1})) ; hidden_norm(g_t)]   # 2H into q/k/v
             h = residual + attn(x)  (residual = hidden_norm(g_t) if norm_before_residual, else g_t)
             h = h + mlp(post_attention_layernorm(h))
    layers 1..L-1: ordinary decoder layers on h (H into q/k/v, no embedding)
    logits over the draft vocabulary = lm_head(norm(h)); target id = draft id + d2t[id]
    the next step's feature is h, or norm(h) with norm_output
Decoder layers are Llama-type, or Qwen3-type with q/k RMSNorms; sliding-window layers see
keys within `sliding_window` positions.

Tree (EAGLE-2): from the pending token, take the top_k children; for depth-1 more
steps expand the top_k best nodes by cumulative log-probability (each node attends
to the committed context, its ancestors and itself); keep the `total_tokens` best
nodes. The target verifies the tree in one forward with a tree mask and per-node
positions (engines/tree.py), the longest path matching the target's greedy choices
is accepted, and the target cache is compacted to that path. Against SafeAILab's
(depth D, top_k K, total_token T) the same tree is this engine's (D+1, K, T-1): its
depth counts levels below the root including the first, SafeAILab's the drafter steps
after it, and its total_token counts the root. vLLM's chain of k speculative tokens is
(k, 1, k).

Hybrid (DeltaNet) targets cannot verify a tree (one recurrent state, many branches),
and the tree form of speculative sampling is not implemented: in both cases the
engine drafts and verifies the single best chain (greedy, or sampled with q and
speculative sampling), with exact rollback. Every record says which path ran.

Checkpoint layouts: speculators (config with transformer_layer_config: v0.2's one Llama
layer and 3 aux features, and the newer Eagle3DraftModel: any number of aux features and
layers, Qwen3 layers, input/fc/output norms, d2t only when the draft vocabulary is
smaller); SafeAILab's EAGLE-3 (Llama-style config with draft_vocab_size, weights midlayer.*,
as safetensors or the published pytorch_model.bin, read without torch). Anything in a
checkpoint this code does not implement is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from engines.base import Draft, Engine
from engines.cache import trim_attention
from engines.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, SLIDING_FIELDS,
                                Field, attention_types, check_rope, check_tensors, float_drafter, quantize_like, read_config, read_fields,
                                read_tensors, refuse_unknown, refuse_unknown_fields, rope_settings, write_checkpoint)
from engines.device import DeviceEngine
from engines.dispatch import pad_keys
from engines.errors import DrafterError
from engines.gemm import small_m_linears
from engines.hidden import activation_dtype, embed, hidden_size, lm_head, num_layers, vocab_size
from engines.prefix import prefix_pass
from engines.static import Shape, StaticState, StaticTree, capacity_for
from engines.target import PREFILL_CHUNK
from engines.tree import accept_tree_on_device

LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
              "max_position_embeddings", "vocab_size")
# Every config.json field this loader reads, with its type and range (engines/checkpoint.py);
# bookkeeping passes (checkpoint.BOOKKEEPING, plus the few below), anything else is refused.
_METADATA = {"tie_word_embeddings", "embed_requires_grad", "bias", "quantization"}  # quantization: quantize_like  # the head is a tensor or the target's; training flags
_LAYER_FIELDS = {"hidden_size": Field("int", ge=1, le=MAX_WIDTH), "num_attention_heads": Field("int", ge=1, le=MAX_HEADS),
                 "num_key_value_heads": Field("int", ge=1, le=MAX_HEADS),
                 "intermediate_size": Field("int", ge=1, le=MAX_WIDTH), "rms_norm_eps": Field("number", gt=0, le=1),
                 "max_position_embeddings": Field("int", ge=1, le=MAX_POSITIONS),
                 "vocab_size": Field("int", ge=1, le=MAX_VOCAB),
                 "num_hidden_layers": Field("int", 1, ge=1, le=MAX_LAYERS, null_ok=True),
                 "head_dim": Field("int", None, ge=1, le=MAX_WIDTH, null_ok=True),
                 "attention_bias": Field("bool", False, null_ok=True), "mlp_bias": Field("bool", False, null_ok=True),
                 "model_type": Field("str", None, null_ok=True), "hidden_act": Field("str", "silu"),
                 **SLIDING_FIELDS}
_TOP_FIELDS = {"transformer_layer_config": Field("dict"),
               "draft_vocab_size": Field("int", None, ge=1, le=MAX_VOCAB, null_ok=True),
               "target_hidden_size": Field("int", None, ge=1, le=MAX_WIDTH, null_ok=True),
               "norm_before_residual": Field("bool", None, null_ok=True),
               "eagle_aux_hidden_state_layer_ids": Field("ints", None, ge=0, le=MAX_LAYERS, null_ok=True),
               "norm_before_fc": Field("bool", False, null_ok=True), "fc_norm": Field("bool", False, null_ok=True),
               "norm_output": Field("bool", False, null_ok=True),
               "speculators_model_type": Field("str", None, choices=("eagle3",), null_ok=True)}


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
    num_hidden_layers: int = 1
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux features (input_norm)
    fc_norm: bool = False  # one RMSNorm per aux feature (fc_norm.i)
    norm_output: bool = False  # the next step is fed norm(h), not h
    qk_norm: bool | None = None  # Qwen3-type layers; None: decided by the checkpoint's tensors
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    layout: str = "speculators"

    @classmethod
    def from_json(cls, cfg: dict, where: str) -> "Eagle3Config":
        """The speculators layout (top-level fields + transformer_layer_config) or SafeAILab's (one
        flat Llama-style config). Every field read is type- and range-checked: DrafterError names
        the file and the field."""
        layout = "speculators" if "transformer_layer_config" in cfg else "eagle"
        top_fields = {k: f for k, f in _TOP_FIELDS.items() if k != "transformer_layer_config"}
        if layout == "speculators":
            layer, pre = read_fields(cfg, {"transformer_layer_config": _TOP_FIELDS["transformer_layer_config"]},
                                     where)["transformer_layer_config"], "transformer_layer_config."
            refuse_unknown_fields(cfg, {*_TOP_FIELDS, *_METADATA, "model_type"}, where)
            refuse_unknown_fields(layer, {*_LAYER_FIELDS, *ROPE_FIELDS, *_METADATA}, where, prefix=pre)
        else:
            layer, pre = cfg, ""
            refuse_unknown_fields(cfg, {*_LAYER_FIELDS, *ROPE_FIELDS, *top_fields, *_METADATA}, where)
        missing = [pre + k for k in LAYER_KEYS if k not in layer]
        if missing:
            raise DrafterError(f"{where}: missing {', '.join(missing)} (an EAGLE-3 config has them)")
        top, lay = read_fields(cfg, top_fields, where), read_fields(layer, _LAYER_FIELDS, where, pre)
        if lay["hidden_act"] != "silu":
            raise DrafterError(f"{where}: hidden_act={lay['hidden_act']!r} is not implemented (EAGLE-3 MLPs are SwiGLU)")
        if top["norm_before_fc"] and top["fc_norm"]:
            raise DrafterError(f"{where}: norm_before_fc and fc_norm exclude each other")
        h, n = lay["hidden_size"], lay["num_hidden_layers"]
        head_dim = lay["head_dim"] or h // lay["num_attention_heads"]
        if head_dim < 1:
            raise DrafterError(f"{where}: field '{pre}num_attention_heads' ({lay['num_attention_heads']}) exceeds "
                               f"'{pre}hidden_size' ({h}) and there is no '{pre}head_dim'")
        types = attention_types(lay, n, where, pre)
        theta, scaling = rope_settings(layer, where, pre)
        check_rope(theta, scaling, head_dim, lay["max_position_embeddings"], where,
                   pre + ("rope_parameters" if layer.get("rope_parameters") else "rope_scaling"))
        aux = top["eagle_aux_hidden_state_layer_ids"]
        norm_before_residual = top["norm_before_residual"]
        return cls(**{k: lay[k] for k in LAYER_KEYS},
                   draft_vocab_size=top["draft_vocab_size"] or lay["vocab_size"],
                   target_hidden_size=top["target_hidden_size"] or h, head_dim=head_dim, num_hidden_layers=n,
                   rope_theta=theta, rope_scaling=scaling,
                   # absent: true for speculators checkpoints (as vLLM reads them), false for SafeAILab's
                   norm_before_residual=layout == "speculators" if norm_before_residual is None else norm_before_residual,
                   norm_before_fc=top["norm_before_fc"], fc_norm=top["fc_norm"], norm_output=top["norm_output"],
                   qk_norm={"qwen3": True, "llama": False}.get(lay["model_type"]), attention_bias=lay["attention_bias"],
                   mlp_bias=lay["mlp_bias"], layer_types=types,
                   sliding_window=lay["sliding_window"] if "sliding_attention" in types else None,
                   aux_layer_ids=aux or None, layout=layout)

    def to_json(self) -> dict:
        layer = {k: getattr(self, k) for k in LAYER_KEYS}
        layer.update(model_type="qwen3" if self.qk_norm else "llama", head_dim=self.head_dim,
                     rope_theta=self.rope_theta, num_hidden_layers=self.num_hidden_layers)
        if self.rope_scaling:
            layer["rope_scaling"] = self.rope_scaling
        if self.sliding_window:
            layer.update(sliding_window=self.sliding_window, layer_types=list(self.layer_types))
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size, "norm_before_residual": self.norm_before_residual,
                "norm_before_fc": self.norm_before_fc, "fc_norm": self.fc_norm, "norm_output": self.norm_output,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids or ())}


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """Low / mid / high as the EAGLE-3 reference picks them (inputs of these layers)."""
    return max(1, min(2, n_layers - 1)), max(1, n_layers // 2), max(1, n_layers - 3)


def feature_layers(aux_layer_ids) -> tuple[int, ...]:
    """The target layers whose outputs are the drafter's features, in layer order: the input of
    layer i is the output of layer i - 1."""
    return tuple(i - 1 for i in sorted(aux_layer_ids))


class _MLP(nn.Module):
    """SwiGLU gate/up/down, as Llama and Qwen3 layers have it (biases with mlp_bias)."""

    def __init__(self, h: int, i: int, bias: bool):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=bias), nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Attention(nn.Module):
    stable = False  # attend over the cache's whole buffer (engines/dispatch.py; set per engine)

    def __init__(self, c: Eagle3Config, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        width = 2 * c.hidden_size if layer == 0 else c.hidden_size  # layer 0 reads [embedding ; feature]
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(width, self.n_heads * d, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, self.n_kv * d, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, self.n_kv * d, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.window = c.sliding_window if c.layer_types[layer] == "sliding_attention" else None
        self.rope = initialize_rope(d, base=c.rope_theta, traditional=False, scaling_config=c.rope_scaling,
                                    max_position_embeddings=c.max_position_embeddings)

    def _heads(self, x, n, norm=None):
        x = x.reshape(*x.shape[:2], n, -1)  # [B, T, n*D] -> [B, n, T, D]
        return (norm(x) if norm is not None else x).transpose(0, 2, 1, 3)

    def __call__(self, x, cache: KVCache | None, offset, tree=None):
        """x [B, T, width], appended to `cache` (if any). With `tree` None the T tokens are
        consecutive positions from `offset` (causal). Otherwise they are tree nodes that all
        sit at position `offset`, and tree(window) gives the [T, S] mask over the cache's
        entries (committed context, earlier tree steps, these nodes)."""
        B, T, _ = x.shape
        q = self._heads(self.q_proj(x), self.n_heads, getattr(self, "q_norm", None))
        k = self._heads(self.k_proj(x), self.n_kv, getattr(self, "k_norm", None))
        v = self._heads(self.v_proj(x), self.n_kv)
        if tree is None:
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        else:  # one position for every node: rotate them as a batch of length-1 sequences
            rot = lambda t: self.rope(t.transpose(2, 1, 0, 3), offset=offset).transpose(2, 1, 0, 3)
            q, k = rot(q), rot(k)
        keys, values = cache.update_and_fetch(k, v) if cache is not None else (k, v)
        mask = self._mask(T, keys.shape[2], offset, tree)
        if self.stable and T > 1 and type(cache) is KVCache and cache.keys.shape[2] > keys.shape[2]:
            mask = pad_keys(self._causal(T, keys.shape[2]) if isinstance(mask, str) else mask, cache.keys.shape[2])
            keys, values = cache.keys, cache.values  # the whole buffer: one cuDNN plan per 256 keys
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))

    @staticmethod
    def _causal(T: int, K: int) -> mx.array:
        # [T, K]: the last T of K cache entries, each seeing the entries up to itself
        return mx.arange(K)[None] <= (K - T + mx.arange(T))[:, None]

    def _mask(self, T: int, S: int, offset: int, tree):
        if tree is not None:
            return tree(self.window)
        if not self.window:
            return "causal" if T > 1 else None
        qpos, kpos = offset + mx.arange(T)[:, None], mx.arange(S)  # causal within the window
        return (kpos <= qpos) & (qpos - kpos < self.window)


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config, layer: int):
        super().__init__()
        h = c.hidden_size
        self.first = layer == 0
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        if self.first:
            self.hidden_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c, layer)
        self.mlp = _MLP(h, c.intermediate_size, c.mlp_bias)

    def __call__(self, embeds, h, cache, offset, tree=None):
        if self.first:
            g = self.hidden_norm(h)
            x = mx.concatenate([self.input_layernorm(embeds), g], axis=-1)
            residual = g if self.norm_before_residual else h
        else:
            x, residual = self.input_layernorm(h), h
        h = residual + self.self_attn(x, cache, offset, tree)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, c: Eagle3Config, own_embedding: bool = False, own_head: bool = True):
        super().__init__()
        self.config = c
        a = len(c.aux_layer_ids) if c.aux_layer_ids else 3  # EAGLE-3's low / mid / high by default
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(a * c.target_hidden_size, eps=c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = [nn.RMSNorm(c.target_hidden_size, eps=c.rms_norm_eps) for _ in range(a)]
        self.fc = nn.Linear(a * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = [Eagle3Layer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if own_head:
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.d2t = mx.zeros((c.draft_vocab_size,), dtype=mx.int64)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse(self, feats: mx.array) -> mx.array:
        """[1, T, A * Ht] concatenated aux features -> [1, T, H]."""
        if self.config.fc_norm:
            parts = mx.split(feats, len(self.fc_norm), axis=-1)
            feats = mx.concatenate([norm(p) for norm, p in zip(self.fc_norm, parts)], axis=-1)
        elif self.config.norm_before_fc:
            feats = self.input_norm(feats)
        return self.fc(feats)

    def step(self, embeds, feats, caches, offset, tree=None):
        """One drafter step: [1, T, H] embeddings and features -> [1, T, H] pre-norm output h.
        logits() / logprobs() take h; the next step takes next_feature(h)."""
        h = feats
        for layer, cache in zip(self.layers, caches if caches is not None else [None] * len(self.layers)):
            h = layer(embeds, h, cache, offset, tree)
        return h

    def next_feature(self, h: mx.array) -> mx.array:
        return self.norm(h) if self.config.norm_output else h

    def logprobs(self, h: mx.array, target=None) -> mx.array:
        """[..., H] pre-norm drafter output -> log-probabilities over the draft vocabulary [..., Vd]."""
        return nn.log_softmax(self.logits(h, target).astype(mx.float32), axis=-1)

    def logits(self, h: mx.array, target=None) -> mx.array:
        if h.ndim == 1:  # MLX's CUDA quantized matmul fails on a 1-D input ("SmallVector out of range")
            return self.logits(h[None], target)[0]
        x = self.norm(h)
        return self.lm_head(x) if "lm_head" in self else lm_head(target, x, softcap=False)

    def to_target(self, draft_ids: mx.array) -> mx.array:
        return draft_ids + self.d2t[draft_ids]


def save_eagle3(drafter: Eagle3Drafter, path: Path, dtype=mx.bfloat16) -> None:
    """Write `drafter` in the speculators layout (t2d: which target ids the draft vocabulary covers)."""
    t2d = mx.zeros((drafter.config.vocab_size,), dtype=mx.bool_)
    t2d[drafter.to_target(mx.arange(drafter.config.draft_vocab_size))] = True
    write_checkpoint(path, drafter.config.to_json(), {**dict(tree_flatten(drafter.parameters())), "t2d": t2d}, dtype)


def _rename(k: str) -> str:
    # SafeAILab's midlayer.* is the speculators layers.0.*; drop a model. prefix
    k = k.removeprefix("model.")
    return "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k


def read_eagle3_config(path: Path) -> tuple[Eagle3Config, dict]:
    """The checked config of the EAGLE-3 drafter at `path` (and its raw JSON), weights unread."""
    raw = read_config(path, "an EAGLE-3 drafter")
    return Eagle3Config.from_json(raw, str(path / "config.json")), raw


def load_eagle3(path: Path, target: nn.Module) -> Eagle3Drafter:
    """Load and validate an EAGLE-3 drafter (speculators or SafeAILab layout); DrafterError on any mismatch."""
    path = Path(path)
    where = path / "config.json"
    c, raw = read_eagle3_config(path)
    n, h, vocab = num_layers(target), hidden_size(target), vocab_size(target)
    weights = read_tensors(path, _rename)
    _check_shapes(c, weights, n, h, vocab, where)
    if c.qk_norm is None:  # no model_type: Qwen3-type layers carry q/k norms
        c.qk_norm = "layers.0.self_attn.q_norm.weight" in weights
    own_head = "lm_head.weight" in weights
    if not own_head and c.draft_vocab_size != vocab:
        raise DrafterError(f"{path}: lm_head.weight is missing and the draft vocabulary ({c.draft_vocab_size}) is not "
                           f"the target's ({vocab}), so the target's head cannot stand in")
    drafter = Eagle3Drafter(c, own_embedding="embed_tokens.weight" in weights, own_head=own_head)
    packed = quantize_like(drafter, weights, raw, where)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters()) if k != "d2t"}
    check_tensors(weights, expected, "EAGLE-3", path, packed)
    if "t2d" in weights and tuple(weights["t2d"].shape) != (vocab,):  # unused (d2t maps), but a damaged one is damage
        raise DrafterError(f"{path}: t2d has shape {tuple(weights['t2d'].shape)}, the target vocabulary is {vocab}")
    refuse_unknown(weights, {*expected, "d2t", "t2d"}, "tensor(s)", path,
                   "this drafter has parts the engine would not run; use an EAGLE-3 checkpoint in a supported layout")
    d2t = _draft_to_target(c, weights, vocab, path)
    dtype = activation_dtype(target)
    cast = lambda w: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w  # packed weights stay uint32
    drafter.load_weights([("d2t", d2t), *((k, cast(weights[k])) for k in expected)])
    drafter.eval()
    float_drafter(drafter, dtype)
    mx.eval(drafter.parameters())
    return drafter


def _check_shapes(c: Eagle3Config, weights: dict, n: int, h: int, vocab: int, where: Path) -> None:
    if c.aux_layer_ids is None:
        c.aux_layer_ids = default_aux_layers(n)
    ids = c.aux_layer_ids
    if len(set(ids)) != len(ids) or not all(1 <= i <= n for i in ids):
        raise DrafterError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} must be distinct layer ids in 1..{n} "
                           "(layer i's input = the output of layer i-1)")
    c.aux_layer_ids = tuple(sorted(ids))  # features are concatenated in layer order
    if c.target_hidden_size != h:
        raise DrafterError(f"{where}: target_hidden_size {c.target_hidden_size} != target hidden size {h}")
    fc = weights.get("fc.weight")
    if fc is not None and "fc.scales" not in weights and fc.shape[-1] != len(ids) * c.target_hidden_size:  # packed: checked after quantize_like
        raise DrafterError(f"{where}: fc.weight takes {fc.shape[-1]} inputs, but {len(ids)} aux layers x target hidden "
                           f"{c.target_hidden_size} = {len(ids) * c.target_hidden_size}: set "
                           "eagle_aux_hidden_state_layer_ids to the layers this drafter was trained on")
    if c.hidden_size != h and "embed_tokens.weight" not in weights:
        raise DrafterError(f"{where}: drafter hidden_size {c.hidden_size} != target hidden size {h} and the checkpoint has no "
                           "embed_tokens of its own to embed tokens with")
    if c.vocab_size != vocab:
        raise DrafterError(f"{where}: drafter vocab_size {c.vocab_size} != target vocab size {vocab}")


def _draft_to_target(c: Eagle3Config, weights: dict, vocab: int, path: Path) -> mx.array:
    """d2t as stored, or the identity where the draft vocabulary is the target's (no d2t written)."""
    if "d2t" not in weights:
        if c.draft_vocab_size != vocab:
            raise DrafterError(f"d2t is missing from {path}: needed to map a {c.draft_vocab_size}-token draft "
                               f"vocabulary onto the target's {vocab}")
        return mx.zeros((c.draft_vocab_size,), dtype=mx.int64)
    if not mx.issubdtype(weights["d2t"].dtype, mx.integer):
        raise DrafterError(f"{path}: d2t is {str(weights['d2t'].dtype).split('.')[-1]}, not integer offsets")
    d2t = weights["d2t"].astype(mx.int64)
    if d2t.shape != (c.draft_vocab_size,):
        raise DrafterError(f"{path}: d2t has shape {tuple(d2t.shape)}, the draft vocabulary is {c.draft_vocab_size}")
    targets = mx.arange(c.draft_vocab_size) + d2t
    if mx.any((targets < 0) | (targets >= vocab)).item():
        raise DrafterError(f"{path}: d2t maps draft ids outside the target vocab (0..{vocab - 1})")
    return d2t


# ---------------------------------------------------------------- the engine

@dataclass
class _Node:
    parent: int  # node index, -1 = root (the pending token)
    score: float  # cumulative log-probability
    depth: int


class Eagle3(Engine):
    name = "eagle3"
    knobs = ("drafter", "verify", "depth", "top_k", "total_tokens")
    drafter_kind = "eagle3"

    @classmethod
    def hidden_layers(cls, cfg, model):
        c, _ = read_eagle3_config(Path(cfg.drafter))
        return feature_layers(c.aux_layer_ids or default_aux_layers(num_layers(model)))  # as load_eagle3 picks them

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_eagle3(Path(cfg.drafter), target.model)
        self.depth, self.top_k, self.total = cfg.depth, cfg.top_k, cfg.total_tokens
        self._check_hidden_layers(feature_layers(self.drafter.config.aux_layer_ids))
        for layer in self.drafter.layers:
            layer.self_attn.stable = target.stable_attention
        self.hybrid = target.layout.recurrent > 0  # one recurrent state cannot serve several branches
        self.draft_ids = self.drafter.to_target(mx.arange(self.drafter.config.draft_vocab_size))  # [Vd] target ids
        self.block = (self.depth if self.hybrid else self.total) + 1  # tokens a full verify feeds

    @property
    def tree_mode(self) -> bool:
        sampling = self.sampler is not None and self.sampler.temperature > 0
        return not (self.hybrid or sampling)

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.features = [hidden]  # [1, n, A*H] target features not yet in the drafter cache
        self.dcache = self.drafter.make_cache()
        self._prepared = None  # prepare()'s commit pass output, for the first draft
        return logits

    def _embed(self, ids: mx.array) -> mx.array:
        # [1, T] ids -> [1, T, H]: the drafter's own embedding where its checkpoint has one, else the target's
        return self.drafter.embed_tokens(ids) if "embed_tokens" in self.drafter else embed(self.target.model, ids)

    def _commit_pass(self, history) -> mx.array:
        """Feed the newly verified positions (feature t, token t+1) into the drafter cache;
        returns the last (pre-norm) output [1, 1, H] (it predicts the token after pending)."""
        feats = self.features[0] if len(self.features) == 1 else mx.concatenate(self.features, axis=1)
        self.features = []
        start = self.dcache[0].offset
        e = self._embed(mx.array([history[start + 1:]], dtype=mx.int32))
        return self.drafter.step(e, self.drafter.fuse(feats), self.dcache, start)[:, -1:]

    def prepare(self, history):
        # The prompt's commit pass (every prompt position into the drafter cache) before the first draft;
        # its part over a restored prefix (bench.context) restored too, so only the rest is fed.
        def over(feats, ids):
            self.features = [feats]
            self._commit_pass(ids)

        feats = self.features[0] if len(self.features) == 1 else mx.concatenate(self.features, axis=1)
        key = ("eagle3", id(self.drafter), self.target.kv, self.target.strategy)
        self.features = [prefix_pass(self.target.prefix, history, feats, key, self.dcache, over)]
        self._prepared = self._commit_pass(history)
        return self._prepared

    def draft(self, history):
        with small_m_linears(self.target.small_m_gemm):  # tree levels are a few rows each (engines/gemm.py)
            return self._draft(history)

    def _draft(self, history):
        depth = self.depth
        root, self._prepared = (self._prepared if self._prepared is not None else self._commit_pass(history)), None
        self.prof.mark("commit_pass", root)
        committed = self.dcache[0].offset
        draft = (self._tree if self.tree_mode else self._chain)(history, root, depth)
        for c in self.dcache:
            trim_attention(c, c.offset - committed)  # tree/chain entries were drafts
        self.prof.mark("tree_expand", draft.tokens)
        return draft

    def _expand(self, tokens: mx.array, feats: mx.array, ancestors: mx.array, pos: int) -> mx.array:
        """One drafter step for the F frontier nodes, all at position `pos`: tokens [F] (target ids),
        the features that predicted them [1, F, H], ancestors [F, n_prev] marking which of the
        n_prev tree entries already in the drafter cache each node descends from. Their K/V are
        appended after those entries; returns [1, F, H]."""
        F, n_prev = ancestors.shape
        context = self.dcache[0].offset - n_prev
        nodes_part = mx.concatenate([ancestors, mx.eye(F, dtype=mx.bool_)], axis=1)  # ancestors, and itself

        def mask(window):  # [F, C + n_prev + F]: the committed context (within a window), ancestors, self
            seen = mx.ones((F, context), dtype=mx.bool_) if not window else \
                mx.broadcast_to(pos - mx.arange(context) < window, (F, context))
            return mx.concatenate([seen, nodes_part], axis=1)

        return self.drafter.step(self._embed(tokens[None]), feats, self.dcache, pos, tree=mask)

    def _children(self, h: mx.array, parent_scores: mx.array) -> tuple[mx.array, mx.array]:
        """The top_k children of each of F nodes from the drafter's outputs h [F, H]: their target
        ids [F * k] and cumulative scores [F * k] (parent's score + log-probability), row by row."""
        lp = self.drafter.logprobs(h, self.target.model)  # [F, Vd]
        top = mx.argsort(-lp, axis=-1)[:, : self.top_k]  # [F, k], best first
        scores = mx.take_along_axis(lp, top, axis=-1) + parent_scores[:, None]
        return self.drafter.to_target(top).reshape(-1), scores.reshape(-1)

    def _tree(self, history, root, depth) -> Draft:
        """EAGLE-2's tree, selected on the device: each level's frontier (its top_k nodes by score),
        their ancestor masks and features stay device arrays, and the host reads the scores once,
        after the last level, to pick the total_tokens best nodes (_select)."""
        k, pending_pos = self.top_k, len(history) - 1
        tokens, scores = self._children(root[0], mx.zeros((1,)))  # level 1: the root's children [k]
        levels, frontiers = [(tokens, scores)], []  # frontiers[i]: which nodes of level i + 1 were expanded
        frontier, feats = mx.arange(k), mx.repeat(self.drafter.next_feature(root), k, axis=1)  # [k], [1, k, H]
        ancestors = mx.zeros((k, 0), dtype=mx.bool_)
        for d in range(2, depth + 1):
            out = self._expand(mx.take(tokens, frontier), feats, ancestors, pending_pos + d - 2)  # [1, F, H]
            frontiers.append(frontier)
            tokens, scores = self._children(out[0], mx.take(scores, frontier))  # level d: [F * k]
            levels.append((tokens, scores))
            if d < depth:  # the next frontier: this level's k best, in node order; parent = row // k
                frontier = mx.sort(mx.argsort(-scores)[:k])
                parent = frontier // k
                own = mx.eye(ancestors.shape[0], dtype=mx.bool_)[parent]  # the parent's own entry
                ancestors = mx.concatenate([ancestors[parent], own], axis=1)  # [k, n_prev + F]
                feats = mx.take(self.drafter.next_feature(out), parent, axis=1)
        level_scores = [s for _, s in levels]
        mx.eval(level_scores, frontiers)  # the round's one host read of the tree
        nodes = self._nodes([s.tolist() for s in level_scores], [f.tolist() for f in frontiers])
        keep = self._select(nodes)
        index = {old: new for new, old in enumerate(keep)}
        return Draft(mx.take(mx.concatenate([t for t, _ in levels]), mx.array(keep)),
                     parents=[index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep])

    def _nodes(self, level_scores: list[list[float]], frontiers: list[list[int]]) -> list[_Node]:
        """Every drafted node in level order, as concat(levels) numbers them: level d + 1's node
        r * k + j is child j of level d's node frontiers[d - 1][r]."""
        nodes = [_Node(-1, s, 1) for s in level_scores[0]]
        start = 0  # the first node index of the level above level d
        for d, (scores, frontier) in enumerate(zip(level_scores[1:], frontiers), start=2):
            nodes += [_Node(start + frontier[i // self.top_k], s, d) for i, s in enumerate(scores)]
            start += len(level_scores[d - 2])
        return nodes

    def _select(self, nodes: list[_Node]) -> list[int]:
        """The total_tokens best nodes by score (ties: the lower index), closed under ancestors,
        depth first with the best child first (_best_first)."""
        keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[: self.total])
        return self._best_first(nodes, self._close_under_ancestors(nodes, keep))

    @staticmethod
    def _close_under_ancestors(nodes, keep):
        out = set(keep)
        for i in keep:
            p = nodes[i].parent
            while p >= 0 and p not in out:
                out.add(p)
                p = nodes[p].parent
        return sorted(out)

    @staticmethod
    def _best_first(nodes, keep):
        """`keep` in depth-first order, each node's children best score first: parents still come
        before children, and a path of best children (the likeliest accepted) sits right after the
        root, where commit_tree keeps it with a trim instead of moving cache entries."""
        children: dict[int, list[int]] = {}
        for i in keep:
            children.setdefault(nodes[i].parent, []).append(i)
        order, stack = [], sorted(children.get(-1, []), key=lambda i: (nodes[i].score, -i))
        while stack:
            i = stack.pop()  # the best remaining sibling: stacked last
            order.append(i)
            stack += sorted(children.get(i, []), key=lambda j: (nodes[j].score, -j))
        return order

    def _chain(self, history, root, depth) -> Draft:
        """The single best (or sampled) path, for hybrid targets and temperature > 0: causal
        drafter steps at consecutive positions, every token kept on the device."""
        pending_pos = len(history) - 1
        pos_out = len(history) - self.prompt_len
        sampling = self.sampler is not None and self.sampler.temperature > 0
        tokens, qs, h = [], [], root
        for d in range(1, depth + 1):
            if d > 1:  # the previous draft with the feature that predicted it, at its parent's position
                h = self.drafter.step(self._embed(tokens[-1][None]), self.drafter.next_feature(h), self.dcache,
                                      pending_pos + d - 2)
            logits = self.drafter.logits(h[0, -1], self.target.model)[None]  # [1, Vd]
            pick, q_draft = self.sampler.propose(logits, pos_out + d - 1)
            if sampling:  # q over the target vocabulary, for speculative sampling
                qs.append(mx.zeros((1, self.drafter.config.vocab_size)).at[:, self.draft_ids].add(q_draft))
            tokens.append(self.drafter.to_target(pick))
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs else None)

    def verify(self, pending, draft):
        tokens = mx.concatenate([pending, draft.tokens])
        if draft.parents is not None:
            logits, self.verified_features = self.target.verify_tree(tokens, draft.parents)
        else:
            logits, self.verified_features = self.target_verify(tokens)  # [K+1, V], [1, K+1, A*H]
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
        return [*super().caches(), *getattr(self, "dcache", [])]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(),
                "tree_path": "chain (hybrid target)" if self.hybrid else "tree (greedy); chain when sampling",
                "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total, "aux_layer_ids": list(c.aux_layer_ids),
                "draft_vocab_size": c.draft_vocab_size, "layout": c.layout, "drafter_layers": c.num_hidden_layers,
                "layer_type": "qwen3" if c.qk_norm else "llama", "layer_types": list(c.layer_types),
                "sliding_window": c.sliding_window, "norm_before_residual": c.norm_before_residual,
                "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm, "norm_output": c.norm_output,
                "rope_theta": c.rope_theta, "own_embedding": "embed_tokens" in self.drafter,
                "own_lm_head": "lm_head" in self.drafter}


# ---------------------------------------------------------------- execution=static

def _causal_slots(capacity: int, start: mx.array, n: int, window: int | None) -> mx.array:
    """[n, capacity]: n tokens written at slots start.. (slot = position), each seeing the slots up to
    its own (within `window`): the eager drafter's causal mask, over a static buffer."""
    q = start + mx.arange(n)[:, None]
    k = mx.arange(capacity)[None]
    mask = k <= q
    return mask & (q - k < window) if window else mask


def _tree_slots(capacity: int, base: mx.array, pos: mx.array, nodes: mx.array, window: int | None) -> mx.array:
    """[F, capacity]: F tree nodes at position `pos` whose entries follow the context in slots base..:
    every context slot (< base; within `window` of pos) and, of the B tree slots from base, those that
    nodes [F, B] marks (ancestors, then itself): the eager _expand mask, over a static buffer."""
    k = mx.arange(capacity)[None]
    rel = k - base
    context = k < base
    if window:
        context = context & (pos - k < window)
    own = mx.take(nodes, mx.clip(rel[0], 0, nodes.shape[1] - 1), axis=1)  # [F, C]
    return mx.where((rel >= 0) & (rel < nodes.shape[1]), own, context)


def _top_children(drafter: Eagle3Drafter, target: nn.Module, h: mx.array, parent_scores: mx.array, k: int):
    """Eagle3._children: the top k children of each of F nodes (drafter outputs h [F, H]) as target ids
    [F * k] and cumulative log-probabilities [F * k], row by row."""
    lp = drafter.logprobs(h, target)  # [F, Vd]
    top = mx.argsort(-lp, axis=-1)[:, :k]  # [F, k], best first
    scores = mx.take_along_axis(lp, top, axis=-1) + parent_scores[:, None]
    return drafter.to_target(top).reshape(-1), scores.reshape(-1)


def select_tree(tokens: mx.array, scores: mx.array, parents: mx.array, depths: mx.array, size: int, depth: int):
    """Eagle3._select on the device, with a fixed node count: of N drafted nodes (tokens, cumulative
    scores, parents as node indices with -1 for the root, depths), the `size` best by score (ties: the
    lower index), kept in node order (parents before children). A child never scores above its parent
    and has the higher index, so the kept set is closed under ancestors, as the eager one is.
    Returns the tree: tokens [size], parents [size] (tree indices, 0 = the root), depths [size + 1]
    and the ancestor-or-self mask [size + 1, size + 1] of [root] + nodes."""
    n = scores.shape[0]
    idx = mx.arange(n)
    ahead = (scores[None] > scores[:, None]) | ((scores[None] == scores[:, None]) & (idx[None] < idx[:, None]))
    keep = ahead.sum(axis=1) < size  # [N]: fewer than `size` nodes rank before it
    order = mx.argsort(mx.where(keep, idx, idx + n))[:size]  # the kept nodes, in node order
    tree_index = mx.cumsum(keep.astype(mx.int32))  # a kept node's index in [root] + nodes
    up = mx.take(parents, order)
    tree_parents = mx.where(up < 0, 0, mx.take(tree_index, mx.maximum(up, 0))).astype(mx.int32)  # [size]
    every = mx.concatenate([mx.zeros((1,), dtype=mx.int32), tree_parents])  # the root is its own parent
    eye = mx.eye(size + 1, dtype=mx.bool_)
    ancestors = eye
    for _ in range(depth):  # each pass adds one more generation of ancestors
        ancestors = eye | mx.take(ancestors, every, axis=0)
    tree_depths = mx.concatenate([mx.zeros((1,), dtype=mx.int32), mx.take(depths, order).astype(mx.int32)])
    return mx.take(tokens, order).astype(mx.int32), tree_parents, tree_depths, ancestors


class Eagle3Static(DeviceEngine):
    """EAGLE-3 in a round that stays on the device (engines/device.py), with the eager Eagle3 as its
    reference. The drafter runs on static caches of its own (slot = position), whose position is set
    from the accepted count on the device:

    - The commit pass is the round's first drafter step: it feeds the previous round's verified
      positions, always depth + 1 of them (target features, and the token after each), at the slots
      from the previous pending position, and takes its root (the output that predicts the token
      after pending) at the accepted count n; the entries past n are masked now and overwritten later.
    - Then `depth` drafts: a chain (top_k = 1, or temperature > 0 with speculative sampling), or a
      tree of a fixed node count (greedy, top_k > 1): every level expanded, the best total_tokens
      nodes chosen on the device (select_tree), verified in one target forward with a tree mask
      (engines/static.py StaticTree), accepted on the device (engines/tree.py accept_tree_on_device),
      and the accepted path's K/V moved to the slots after the position (StaticTree.keep_path).

    Each drafting phase is one compiled function over the drafter's state (one trace per shape,
    counted in `traces`), the target's forwards compiled by StaticTarget / StaticTree."""

    name = "eagle3"
    knobs = Eagle3.knobs
    drafter_kind = "eagle3"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return Eagle3.hidden_layers(cfg, model)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_eagle3(Path(cfg.drafter), target.model)
        self._check_hidden_layers(feature_layers(self.drafter.config.aux_layer_ids))
        self.depth, self.top_k, self.total = cfg.depth, cfg.top_k, cfg.total_tokens
        c = self.drafter.config
        # Its layers mask their own window (Eagle3Attention gets the mask), so the caches keep no window.
        self.dstate = StaticState([Shape(c.num_key_value_heads, c.head_dim, None)] * c.num_hidden_layers,
                                  activation_dtype(target.model))
        self.tree = StaticTree(target)
        self.size = min(self.total, self.top_k + (self.depth - 1) * self.top_k ** 2)  # nodes a tree keeps
        self.draft_ids = self.drafter.to_target(mx.arange(c.draft_vocab_size))  # [Vd] target ids
        self.traces = 0  # the drafter's compiled traces
        self._phases: dict = {}
        self.block = self._block(True)

    @property
    def tree_mode(self) -> bool:
        return self.top_k > 1 and (self.sampler is None or self.sampler.temperature == 0)

    def _block(self, tree: bool) -> int:
        return (self.size if tree and self.top_k > 1 else self.depth) + 1  # the tokens a verify feeds

    @property
    def reach(self) -> int:
        """The most drafts a round can accept: `depth` (a tree's block - 1 counts its nodes)."""
        return self.depth

    @property
    def tree_size(self) -> int:
        """Nodes a round verifies besides the pending token in tree mode; 0 for a chain (as Round's)."""
        return self.size if self.tree_mode else 0

    def _embed(self, ids: mx.array) -> mx.array:
        return self.drafter.embed_tokens(ids) if "embed_tokens" in self.drafter else embed(self.target.model, ids)

    # -- start: the target's prefill, the drafter's over all prompt positions but the last

    def start(self, prompt, max_new_tokens):
        self.block = self._block(self.tree_mode)
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        d, p = self.depth, len(prompt)
        # a commit pass of depth + 1 and a tree's (depth - 1) * top_k entries past the last position
        self.dstate.reset(capacity_for(p + max_new_tokens + 2 * self.block + (d + 1) + (d - 1) * self.top_k))
        for s in range(0, p - 1, PREFILL_CHUNK):  # feature t with token t + 1, eagerly (prompts vary)
            e = min(s + PREFILL_CHUNK, p - 1)
            self._commit(fwd.hidden[:, s:e], mx.array(prompt[s + 1: e + 1], dtype=mx.int32), None)
            mx.eval(self.dstate.arrays)
        self.dstate.set_position(mx.array(p - 1, dtype=mx.int32))
        # The first round's commit pass: the prompt's last position (followed by the first token), padded.
        width = fwd.hidden.shape[-1]
        self.feats = mx.concatenate([fwd.hidden[:, p - 1:], mx.zeros((1, d, width), fwd.hidden.dtype)], axis=1)
        self.fed = mx.concatenate([self.pending, mx.zeros((d,), dtype=mx.int32)])  # [depth + 1]
        self.n = mx.zeros((1,), dtype=mx.int32)
        return self.pending

    def _commit(self, feats: mx.array, fed: mx.array, n: mx.array | None) -> mx.array:
        """Feed verified positions at the drafter's position: feats [1, T, A * Ht] and the token after
        each, fed [T]. With n ([1] accepted count), the root [1, 1, H] (the output at n) and the
        position moved past n; without, the whole output, the position past all T."""
        caches = self.dstate.caches
        start, t = caches[0].offset, fed.shape[0]
        out = self.drafter.step(self._embed(fed[None]), self.drafter.fuse(feats), caches, start + mx.arange(t),
                                tree=lambda w: _causal_slots(self.dstate.capacity, start, t, w))
        if n is None:
            return out
        self.dstate.set_position(start + n[0] + 1)
        return mx.take(out, n, axis=1)

    # -- the drafting phases, each one compiled function of the drafter's state

    def _phase(self, tree: bool):
        key = (tree, self.sampler.temperature, self.sampler.seed)
        if key not in self._phases:  # the sampler is read while tracing: one compiled phase per sampler
            fn = self._draft_tree if tree else self._draft_chain
            self._phases[key] = mx.compile(fn, inputs=self.dstate.arrays, outputs=self.dstate.arrays)
        return self._phases[key]

    def _draft_chain(self, feats, fed, n, out_pos):
        """The commit pass, then `depth` causal drafter steps -> drafts [K] and q [K, V] (or a [0] placeholder)."""
        self.traces += 1  # runs only while mx.compile traces
        sampling = self.sampler.temperature > 0
        root = self._commit(feats, fed, n)
        base = self.dstate.position
        tokens, qs, h = [], [], root
        for d in range(1, self.depth + 1):
            if d > 1:  # the previous draft with the feature that predicted it, at its parent's position
                pos = base + d - 2
                h = self.drafter.step(self._embed(tokens[-1][None]), self.drafter.next_feature(h), self.dstate.caches,
                                      pos[None], tree=lambda w, p=pos: _causal_slots(self.dstate.capacity, p, 1, w))
            logits = self.drafter.logits(h[0, -1], self.target.model)[None]  # [1, Vd]
            pick, q = self.sampler.propose(logits, out_pos + d - 1)
            if sampling:  # q over the target vocabulary, for speculative sampling
                qs.append(mx.zeros((1, self.drafter.config.vocab_size)).at[:, self.draft_ids].add(q))
            tokens.append(self.drafter.to_target(pick).astype(mx.int32))
        self.dstate.set_position(base)  # the next commit pass starts at this round's pending position
        return mx.concatenate(tokens), (mx.concatenate(qs) if qs else mx.zeros((0,)))

    def _draft_tree(self, feats, fed, n, out_pos):
        """The commit pass, then EAGLE-2's tree (Eagle3._tree) with every level expanded and `size`
        nodes kept -> select_tree's tokens, parents, depths and ancestors."""
        self.traces += 1
        k, capacity = self.top_k, self.dstate.capacity
        root = self._commit(feats, fed, n)
        base = self.dstate.position
        tokens, scores = _top_children(self.drafter, self.target.model, root[0], mx.zeros((1,)), k)  # level 1
        all_tokens, all_scores = [tokens], [scores]
        parents, depths = [mx.full((k,), -1, dtype=mx.int32)], [mx.full((k,), 1, dtype=mx.int32)]
        frontier, feats_ = mx.arange(k), mx.repeat(self.drafter.next_feature(root), k, axis=1)  # [k], [1, k, H]
        ancestors, above = mx.zeros((k, 0), dtype=mx.bool_), 0  # above: the first node index of the level above
        for d in range(2, self.depth + 1):
            f = frontier.shape[0]
            nodes = mx.concatenate([ancestors, mx.eye(f, dtype=mx.bool_)], axis=1)  # ancestors, and itself
            pos = base + d - 2
            out = self.drafter.step(self._embed(mx.take(tokens, frontier)[None]), feats_, self.dstate.caches, pos,
                                    tree=lambda w, p=pos, m=nodes: _tree_slots(capacity, base, p, m, w))  # [1, F, H]
            parents.append((above + mx.repeat(frontier, k)).astype(mx.int32))
            above += tokens.shape[0]
            tokens, scores = _top_children(self.drafter, self.target.model, out[0], mx.take(scores, frontier), k)
            all_tokens.append(tokens)
            all_scores.append(scores)
            depths.append(mx.full((f * k,), d, dtype=mx.int32))
            if d < self.depth:  # the next frontier: this level's k best, in node order; parent = row // k
                frontier = mx.sort(mx.argsort(-scores)[:k])
                row = frontier // k
                ancestors = mx.concatenate([ancestors[row], mx.eye(f, dtype=mx.bool_)[row]], axis=1)
                feats_ = mx.take(self.drafter.next_feature(out), row, axis=1)
        self.dstate.set_position(base)
        return select_tree(mx.concatenate(all_tokens), mx.concatenate(all_scores), mx.concatenate(parents),
                           mx.concatenate(depths), self.size, self.depth)

    # -- the round

    def round(self):
        if self.tree_mode:
            return self._tree_round()
        drafts, q = self._phase(False)(self.feats, self.fed, self.n, self.out_pos)
        outcome, fwd = self.verify_and_accept(drafts, q if self.sampler.temperature > 0 else None)
        self.feats, self.fed, self.n = fwd.hidden, outcome[1:], outcome[:1]  # the next commit pass
        return outcome

    def _tree_round(self):
        start = self.target.position  # the pending token's; the tree's root goes there
        tokens, parents, depths, ancestors = self._phase(True)(self.feats, self.fed, self.n, self.out_pos)
        fwd = self.tree.forward(mx.concatenate([self.pending, tokens]), depths, ancestors)  # logits [T, V]
        choices = self.sampler.choose(fwd.logits, self.out_pos)  # greedy: argmax at every tree node
        forced = None if self.force is None else self.force.count(self.depth, self.out_pos)
        outcome, path = accept_tree_on_device(tokens, parents, choices, self.depth, forced)  # [1 + D + 1], [D + 1]
        n = outcome[:1]
        self.tree.keep_path(start, path, n[0])  # the accepted path contiguous after the position
        self.pending = mx.take(outcome[1:], n).astype(mx.int32)
        self.out_pos = self.out_pos + n[0] + 1
        self.feats, self.fed, self.n = mx.take(fwd.hidden, path, axis=1), outcome[1:], n
        return outcome

    def caches(self):
        return [*super().caches(), *self.dstate.caches]

    def state(self):
        return [*super().state(), self.dstate.arrays, self.feats, self.fed, self.n]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "tree_path": "tree (greedy, fixed size); chain when sampling or top_k = 1",
                "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total, "tree_size": self.size,
                "aux_layer_ids": list(c.aux_layer_ids), "draft_vocab_size": c.draft_vocab_size,
                "drafter_layers": c.num_hidden_layers, "drafter_traces": self.traces,
                "tree_traces": self.tree.traces, "drafter_capacity": self.dstate.capacity}
