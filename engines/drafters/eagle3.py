"""The EAGLE-3 drafter (arXiv 2503.01840): a network on fused target features, its config and loader.

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

from engines.errors import DrafterError
from engines.runtime.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS,
                                        SLIDING_FIELDS, Field, attention_types, check_rope, check_tensors,
                                        float_drafter, quantize_like, read_config, read_fields, read_tensors,
                                        refuse_unknown, refuse_unknown_fields, rope_settings, write_checkpoint)
from engines.runtime.dispatch import pad_keys
from engines.runtime.hidden import activation_dtype, hidden_size, lm_head, num_layers, vocab_size

LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
              "max_position_embeddings", "vocab_size")
# Every config.json field this loader reads, with its type and range (engines/runtime/checkpoint.py);
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
    stable = False  # attend over the cache's whole buffer (engines/runtime/dispatch.py; set per engine)

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
