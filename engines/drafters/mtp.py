"""The MTP drafter: the multi-token-prediction head of Qwen3.5 / Qwen3-Next, or one of a dense target's
own layer class, read from a checkpoint's mtp.* tensors.

Qwen3.5 and Qwen3-Next checkpoints ship an `mtp.*` module that mlx-lm drops on load. It predicts
token t+2 from the target's final-normed hidden state at t and the embedding of token t+1 (the
layout of vLLM's qwen3_next_mtp):

    x = fc([pre_fc_norm_embedding(embed(tok_{t+1})) ; pre_fc_norm_hidden(h_t)])   # [H, 2H]
    x = layers[0](x)           # one full-attention decoder layer shaped like the
                               # target's (gated q, q/k norms), own KV cache, position t
    h' = norm(x); logits = target lm_head(h')

Dense full-attention targets (llama, qwen2, qwen3, mistral families) take the same head with their
own decoder layer class: the form `python -m train train=mtp` writes for them, as a drafter
directory holding only the mtp.* tensors. Weights are read straight from the checkpoint's
safetensors. Original Hugging Face checkpoints store Gemma-style RMSNorm weights (scale = 1 + w)
and unstacked conv1d; when the checkpoint is in that form (as mlx-lm's own qwen3_5 sanitize
detects it) the MTP norms get the same +1.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from engines.errors import DrafterError, Unsupported
from engines.runtime.checkpoint import check_tensors, float_drafter, load_safetensors, quantize_like, read_json
from engines.runtime.hidden import activation_dtype, decoder, text_model

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
