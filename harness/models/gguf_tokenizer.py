"""A `tokenizers` tokenizer rebuilt from a GGUF file's metadata, the way llama.cpp tokenizes.

A GGUF carries no tokenizer.json: the vocabulary, merges, token types and the name of
the pre-tokenizer split ("smollm", "llama-bpe", "qwen2", ...) are metadata. llama.cpp
maps each split name to a list of regexes applied one after another (llama-vocab.cpp);
the same regexes here, as `Split(isolated)` steps before the byte-level alphabet, give
the same pieces. A split name not in the table is refused: a tokenizer that cuts text
differently from the model's own would measure a different workload without saying so.

Two vocabulary kinds are built:
- "gpt2": byte-level BPE with the file's merges (SmolLM2, Llama 3, Qwen2/3).
- "llama": SentencePiece as llama.cpp runs it (Gemma 3): spaces become U+2581, the
  adjacent pair whose concatenation is the highest-scoring token merges first, and text
  no token covers falls back to <0xNN> byte tokens. As a BPE model: every split of a
  token into two tokens is a merge, ranked by the merged token's score.
"""

from __future__ import annotations

from harness.errors import GGUFError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (regexes in order, ignore_merges): llama.cpp's table, for the names
# the supported architectures' converters write.
PRE_SPLITS = {
    "gpt-2": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "llama-bpe": ([_LLAMA3], True),
    "llama3": ([_LLAMA3], True),
    "qwen2": ([_QWEN2], False),
    "deepseek-r1-qwen": ([_QWEN2], False),
}

CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # llama.cpp token types


def build_tokenizer(meta: dict, where: str):
    """(tokenizers.Tokenizer, tokenizer_config dict) for the file whose metadata is `meta`."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{where} has no tokenizer.ggml.tokens: a GGUF without its vocabulary cannot be run here")
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, where)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens)
    else:
        raise GGUFError(f"{where}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                        "supported: gpt2 (byte-level BPE), llama (SentencePiece)")
    _add_special(tok, meta, tokens)
    return tok, _tokenizer_config(meta, tokens, kind)


def _byte_level(meta: dict, tokens: list[str], where: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        raise GGUFError(f"{where}: pre-tokenizer split {pre!r} (tokenizer.ggml.pre) is not in this importer's "
                        f"table ({', '.join(PRE_SPLITS)}); refusing to tokenize differently from llama.cpp")
    regexes, ignore_merges = PRE_SPLITS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types, vocab), byte_fallback=True,
                               unk_token=tokens[unk] if unk is not None else None, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _spm_merges(tokens, scores, types, vocab) -> list[tuple[str, str]]:
    # Every split of a normal token into two tokens, best merged score first (llama.cpp's
    # bigram order), then earlier token id, then the split point.
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] in (CONTROL, BYTE) or len(t) < 2:
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, cut, a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def _add_special(tok, meta: dict, tokens: list[str]) -> None:
    from tokenizers import AddedToken, processors

    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if _adds_bos(meta) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])


def _adds_bos(meta: dict) -> bool:
    # llama.cpp's default: SentencePiece vocabularies add BOS unless the file says otherwise.
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _tokenizer_config(meta: dict, tokens: list[str], kind: str) -> dict:
    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos_token_id"),
           "eos_token": token("eos_token_id"), "unk_token": token("unknown_token_id"),
           "pad_token": token("padding_token_id"), "add_bos_token": _adds_bos(meta),
           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
           "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return {k: v for k, v in cfg.items() if v is not None}
