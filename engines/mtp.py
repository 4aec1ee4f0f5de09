"""MTP: the Qwen3.5 / Qwen3-Next multi-token-prediction head as a drafter.

Qwen3.5 and Qwen3-Next checkpoints ship an `mtp.*` module that mlx-lm drops on
load. It predicts token t+2 from the target's final-normed hidden state at t and
the embedding of token t+1 (the layout of vLLM's qwen3_next_mtp):

    x = fc([pre_fc_norm_embedding(embed(tok_{t+1})) ; pre_fc_norm_hidden(h_t)])   # [H, 2H]
    x = layers[0](x)           # one full-attention decoder layer shaped like the
                               # target's (gated q, q/k norms), own KV cache, position t
    h' = norm(x); logits = target lm_head(h')

K > 1 chains the same layer: h' and the drafted token feed the next step.

Dense full-attention targets (llama, qwen2, qwen3, mistral families) take the same head
with their own decoder layer class: the form `python -m train train=mtp` writes
for them, as a drafter directory holding only the mtp.* tensors.

One round, with the MTP cache covering the positions whose target hidden states it
has seen: a first pass over the newly verified positions (one token each) drafts
d1; K-1 chained steps draft d2..dK; verify [pending, d1..dK]; the chained steps'
cache entries are trimmed (they were built on MTP's own hidden, not the target's)
and the accepted positions' target hidden states feed the next first pass.

Weights are read straight from the checkpoint's safetensors. Original Hugging Face
checkpoints store Gemma-style RMSNorm weights (scale = 1 + w) and unstacked conv1d;
when the checkpoint is in that form (as mlx-lm's own qwen3_5 sanitize detects it)
the MTP norms get the same +1.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from engines.base import Draft, Engine
from engines.cache import trim_attention
from engines.checkpoint import check_tensors, float_drafter, load_safetensors, quantize_like, read_json
from engines.device import DeviceEngine
from engines.errors import DrafterError, Unsupported
from engines.gemm import small_m_linears
from engines.hidden import activation_dtype, decoder, embed, final_norm, lm_head, num_layers, text_model
from engines.prefix import prefix_pass
from engines.static import StaticState, attention_shape, capacity_for

NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
         "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
         "layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight")


QWEN_NEXT = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # hybrid targets whose releases ship mtp.*
DENSE = ("llama", "qwen2", "qwen3", "mistral")  # full-attention decoders whose layer takes (args) alone


def text_args(model: nn.Module):
    """The text ModelArgs of a target an MTP head can be built for, or Unsupported."""
    args = getattr(text_model(model), "args", None)
    if getattr(model, "model_type", None) not in (*QWEN_NEXT, *DENSE) or args is None:
        raise Unsupported(f"MTP needs a Qwen3.5 / Qwen3-Next or a dense full-attention target "
                          f"({', '.join(DENSE)}); this is {getattr(model, 'model_type', '?')}")
    return args


def _decoder_layer(model: nn.Module, args) -> nn.Module:
    """One full-attention decoder layer of the target's own class and shape."""
    layer_cls = type(decoder(model).layers[0])
    if model.model_type in QWEN_NEXT:
        layer = layer_cls(args, layer_idx=args.full_attention_interval - 1)
        assert not layer.is_linear, "the MTP layer must be a full-attention layer"
        return layer
    return layer_cls(args)


class MTPHead(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        args = text_args(model)
        h = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [_decoder_layer(model, args)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: KVCache | None = None) -> mx.array:
        """embeds, hidden: [1, T, H] (token t+1, target state at t) -> [1, T, H] after mtp.norm."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1))
        x = self.layers[0](x, create_attention_mask(x, cache), cache)
        return self.norm(x)


def _checkpoint_tensors(path: Path) -> tuple[dict, bool]:
    """The mtp.* tensors of a checkpoint (prefix stripped) and whether it is in HF form."""
    mtp, hf_form = {}, False
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_safetensors(f).items():  # DrafterError naming a damaged file
            name = k.split("mtp.", 1)[1] if (k.startswith("mtp.") or ".mtp." in k) else None
            if name is not None:
                mtp[name] = v
            elif "conv1d.weight" in k and v.shape[-1] != 1:
                hf_form = True
    return mtp, hf_form


def _stack_experts(w: dict) -> dict:
    # HF MoE layouts -> mlx-lm's switch_mlp: fused gate_up_proj, or one tensor per expert.
    p = "layers.0.mlp."
    if p + "experts.gate_up_proj" in w:
        gate_up = w.pop(p + "experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        w[p + "switch_mlp.gate_proj.weight"], w[p + "switch_mlp.up_proj.weight"] = gate_up[..., :mid, :], gate_up[..., mid:, :]
        w[p + "switch_mlp.down_proj.weight"] = w.pop(p + "experts.down_proj")
    elif p + "experts.0.gate_proj.weight" in w:
        n = len({k.split(".")[4] for k in w if k.startswith(p + "experts.")})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w[p + f"switch_mlp.{proj}.weight"] = mx.stack([w.pop(p + f"experts.{e}.{proj}.weight") for e in range(n)])
    return w


def load_mtp(path: Path, model: nn.Module) -> MTPHead:
    """The MTP head of the checkpoint at `path` for its loaded target; DrafterError names what is wrong."""
    head = MTPHead(model)
    mtp, hf_form = _checkpoint_tensors(Path(path))
    if not mtp:
        raise DrafterError(f"{path} has no mtp.* tensors: this checkpoint carries no MTP head "
                           "(mlx-lm conversions drop it; use the original Hugging Face checkpoint)")
    mtp = _stack_experts(mtp)
    config = read_json(Path(path) / "config.json") if (Path(path) / "config.json").is_file() else {}
    packed = quantize_like(head, mtp, config if any(k.endswith(".scales") for k in mtp) else {}, Path(path) / "config.json")
    expected = {k: tuple(v.shape) for k, v in tree_flatten(head.parameters())}
    check_tensors({f"mtp.{k}": v for k, v in mtp.items()}, {f"mtp.{k}": v for k, v in expected.items()}, "MTP", path,
                  frozenset(f"mtp.{k}" for k in packed))
    if hf_form:
        mtp.update({k: mtp[k] + 1.0 for k in NORMS if k in mtp})  # Gemma-style (1 + w) RMSNorm
    dtype = activation_dtype(model)
    head.load_weights([(k, mtp[k].astype(dtype) if mx.issubdtype(mtp[k].dtype, mx.floating) else mtp[k])
                       for k in expected])
    head.eval()
    float_drafter(head, dtype)
    mx.eval(head.parameters())
    return head


class MTP(Engine):
    name = "mtp"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "mtp"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return (num_layers(model) - 1,)  # the last layer's output (final-normed here, as MTP reads it)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.head = load_mtp(Path(cfg.drafter), target.model)
        self.k = cfg.block_size - 1
        self._check_hidden_layers(self.hidden_layers(cfg, target.model))

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.hidden = [self._normed(hidden)]  # target states not yet seen by MTP
        self.cache = KVCache()
        self.chained = 0
        self._prepared = None  # prepare()'s first pass over the prompt, for the first draft
        return logits

    def prepare(self, history):
        # MTP's first pass over every prompt position before the first draft; its part over a restored
        # prefix (bench.context) restored too, so only the rest is fed.
        def over(hidden, ids):
            self.hidden = [hidden]
            self._first_pass(ids)

        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, axis=1)
        key = ("mtp", id(self.head), self.target.kv, self.target.strategy)
        self.hidden = [prefix_pass(self.target.prefix, history, hidden, key, [self.cache], over)]
        self._prepared = self._first_pass(history)
        return self._prepared

    def _first_pass(self, history) -> mx.array:
        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, axis=1)  # [1, n, H]
        self.hidden = []
        start = self.cache.offset  # first position MTP has not seen: pair (h_t, token t+1)
        return self._step(mx.array(history[start + 1:], dtype=mx.int32), hidden)  # [1, n, H]

    def _normed(self, h):
        return final_norm(self.target.model, h)  # the target's last-layer output after its final norm

    def _step(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        x = embed(self.target.model, tokens[None])  # [T] ids -> [1, T, H]
        with self.target.stable():  # its layer is the target's class: one cuDNN plan per cache bucket on CUDA
            return self.head(x, hidden, self.cache)

    def draft(self, history):
        with small_m_linears(self.target.small_m_gemm):  # its first step covers every accepted position
            return self._draft(history)

    def _draft(self, history):
        k = self.k
        out, self._prepared = (self._prepared if self._prepared is not None else self._first_pass(history)), None
        self.prof.mark("mtp_first", out)
        pos = len(history) - self.prompt_len
        tokens, qs = [], []
        h = out[:, -1:]
        for i in range(k):
            if i:
                h = self._step(tokens[-1], h)  # chain: MTP's own state and draft feed the next step
            t, q = self.sampler.propose(lm_head(self.target.model, h[0]), pos + i)  # [1] ids on the device
            tokens.append(t)
            qs.append(q)
        self.chained = k - 1
        self.prof.mark("mtp_chain", tokens[-1])
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs[0] is not None else None)

    def verify(self, pending, draft):
        logits, self.verified = self.target_verify(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, H]
        return logits

    def rollback(self, n_accepted, draft):
        kept = self.verified[:, : n_accepted + 1]  # [1, n+1, H] of the kept positions
        self.target.commit(n_accepted + 1)
        trim_attention(self.cache, self.chained)  # chained entries were built on MTP's own states
        self.chained = 0
        self.hidden.append(self._normed(kept))

    def caches(self):
        return [*super().caches(), *([self.cache] if hasattr(self, "cache") else [])]

    def describe(self):
        return {**super().describe(), "k": self.k}


class MTPStatic(DeviceEngine):
    """MTP in a round that stays on the device (engines/device.py), on dense targets (a Qwen3.5 /
    Qwen3-Next target keeps DeltaNet caches, which have no static form).

    The head's layer keeps its K/V in a StaticKVCache at a device position: the positions whose
    target hidden states it has seen. Each round's first pass always covers the K + 1 positions of
    the previous verify (fixed shape): pairs (target hidden at tp + i, the token emitted at
    tp + i + 1), of which the first `kept` = n + 1 are real. The position then moves by `kept`, the
    first draft is read from the pass's output at row kept - 1 (mx.take with a device index), and
    K - 1 chained steps draft the rest; their entries are dropped again by moving the position back
    (they were built on the head's own states). Both phases are compiled, one trace per shape."""

    name = "mtp"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "mtp"
    fusable = True  # its state: engine attributes and a StaticState (DeviceEngine.next_round)

    @classmethod
    def hidden_layers(cls, cfg, model):
        return MTP.hidden_layers(cfg, model)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.k = cfg.block_size - 1
        if self.k < 1:
            raise Unsupported(f"mtp needs method.block_size >= 2 (one draft or more); got {cfg.block_size}")
        self.block = self.k + 1
        self.head = load_mtp(Path(cfg.drafter), target.model)
        self._check_hidden_layers(self.hidden_layers(cfg, target.model))
        self.mstate = StaticState([attention_shape(self.head.layers[0])], activation_dtype(target.model))
        self.drafter_traces = 0  # compiled traces of the first pass and the chained step: one per shape each
        self._first = mx.compile(self._first_pass, inputs=self.mstate.arrays, outputs=self.mstate.arrays)
        self._chain = mx.compile(self._chain_step, inputs=self.mstate.arrays, outputs=self.mstate.arrays)

    def start(self, prompt, max_new_tokens):
        # DeviceEngine.start, keeping the prompt's hidden states: the head's first pass over the prompt.
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        self.mstate.reset(capacity_for(len(prompt) + max_new_tokens + 4 * self.block))
        p, hidden = len(prompt), fwd.hidden  # [1, P, H] raw last-layer outputs
        if p > 1:  # every prompt pair but the last, eagerly (P varies per prompt); its output is not read
            ids = mx.array(prompt[1:], dtype=mx.int32)[None]  # [1, P-1]: the token after each position
            self.head(embed(self.target.model, ids), final_norm(self.target.model, hidden[:, :-1]),
                      self.mstate.caches[0])
        # The last prompt position (paired with the first token) is the first round's one real row.
        pad = self.block - 1
        self.context = mx.concatenate([hidden[:, -1:], mx.zeros((1, pad, hidden.shape[-1]), hidden.dtype)], axis=1)
        self.next_tokens = mx.concatenate([self.pending, mx.zeros((pad,), dtype=mx.int32)])  # [K+1]
        self.kept = mx.array(1, dtype=mx.int32)
        return self.pending

    def _first_pass(self, tokens: mx.array, hidden: mx.array, kept: mx.array):
        # tokens [K+1] (the token after each position), hidden [1, K+1, H] of the last verify (first
        # `kept` real) -> logits [1, V] of the first draft and the head's state there [1, 1, H].
        self.drafter_traces += 1  # runs only while mx.compile traces
        model, start = self.target.model, self.mstate.position
        out = self.head(embed(model, tokens[None]), final_norm(model, hidden), self.mstate.caches[0])  # [1, K+1, H]
        h = mx.take(out, (kept - 1)[None], axis=1)  # [1, 1, H] at the last real row
        self.mstate.set_position(start + kept)  # the rows past it were not real: masked, then overwritten
        return lm_head(model, h[0]), h

    def _chain_step(self, token: mx.array, h: mx.array):
        # token [1], h [1, 1, H]: the head's own last state and draft -> logits [1, V], state [1, 1, H].
        self.drafter_traces += 1
        out = self.head(embed(self.target.model, token[None]), h, self.mstate.caches[0])
        return lm_head(self.target.model, out[0]), out

    def round(self):
        logits, h = self._first(self.next_tokens, self.context, self.kept)
        seen = self.mstate.position  # where the next first pass writes
        tokens, qs = [], []
        for i in range(self.k):
            if i:
                logits, h = self._chain(tokens[-1], h)
            t, q = self.sampler.propose(logits, self.out_pos + i)  # [1] id on the device
            tokens.append(t.astype(mx.int32))
            qs.append(q)
        self.mstate.set_position(seen)  # the chained entries were built on the head's own states
        outcome, fwd = self.verify_and_accept(mx.concatenate(tokens), mx.concatenate(qs) if qs[0] is not None else None)
        # The next first pass: (hidden at tp + i, the token emitted at tp + i + 1), the first n + 1 real.
        self.context, self.next_tokens, self.kept = fwd.hidden, outcome[1:], outcome[0] + 1
        return outcome

    def caches(self):
        return [*super().caches(), *self.mstate.caches]

    def state(self):
        return [*super().state(), self.mstate.arrays, self.context, self.next_tokens, self.kept]

    def describe(self):
        return {**super().describe(), "k": self.k, "drafter_traces": self.drafter_traces}
