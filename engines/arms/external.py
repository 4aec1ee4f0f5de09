"""Reference implementations, run as arms of a cell beside the harness's own engines.

A speedup is only as honest as its baseline, so the implementations users already
run are measured in the same cell, on the same prompt ids, timed the same way (tokens
after the first over the time after the first token):

- `mlx_lm`: mlx-lm's `generate_step`, the loop behind `mlx_lm.generate`. Pair any method
  with it (`reference=mlx_lm`), or `method=base reference=mlx_lm` for the harness's own
  overhead against it.
- `mlx_lm_spec`: mlx-lm's `speculative_generate_step` (`mlx_lm.generate --draft-model`) on the
  cell's target and draft model: `method=draft_model reference=mlx_lm_spec`.
- `dflash_zlab`: z-lab's DFlash reference (`dflash` on PyPI, `dflash.model_mlx`), on the
  same target and drafter directories: `method=dflash_a reference=dflash_zlab`.

They generate on their own, so they are not driven round by round: `generate` yields the
same Prefill/Round events the loop yields for the harness's engines, one Round per token
(mlx-lm) or per verify (z-lab). They never profile. The tokenizer is passed only because
these APIs ask for one (stop tokens, detokenizing); ids go in and come out.
"""

from __future__ import annotations

import copy
import itertools
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from engines.base import Engine, Prefill, Round
from engines.errors import Unsupported
from engines.runtime.hidden import decoder
from engines.runtime.patches import zlab_layers_restored, zlab_make_prompt_cache, zlab_snapshot_download

ANCHORS_INSTALL = "pip install -e '.[anchors]'"


class External(Engine):
    """An arm whose generation loop belongs to someone else (see the module docstring)."""

    drafts = False
    external = True
    tokenizer = None  # an mlx-lm TokenizerWrapper, set by whoever builds the arm

    def generate(self, prompt: list[int], max_new_tokens: int, sampler, stop_tokens: frozenset[int]) -> Iterator:
        raise NotImplementedError

    def caches(self) -> list:
        return list(getattr(self, "_caches", []))

    def who(self) -> str:
        """The arm as an error names it (an outside arm adds its command or address)."""
        return self.name


class ArmReportError(RuntimeError):
    """An arm said something impossible (a token id outside the vocabulary, counts that contradict
    its tokens, time running backwards) or stopped short of its budget: its cell is an error."""


def stamped_events(steps, t0: float, arm: External):
    """(Prefill, Round...) from an iterator of (arrival time, tokens emitted, drafted, accepted,
    [V] log-probabilities or None) per step, for every arm whose loop is not the harness's.
    A first step that drafted was a whole verify round (mlx-lm's speculative loop, an engine or
    server that answers per round): its first token is the Prefill event, and the rest of the
    round, which arrived with it, a Round that keeps its drafted and accepted counts. Every
    step is checked here, the one door outside results come through (ArmReportError); its token
    count against its accepted count once a later step shows that no budget or stop token cut it."""
    last, before = None, None  # before: the previous step's (token count, accepted, first), awaiting that check
    for i, (t, emitted, drafted, accepted, scores) in enumerate(steps):
        check_step(arm, t, last if last is not None else t0, emitted, drafted, accepted, first=last is None)
        if before is not None:
            check_uncut(arm, i - 1, *before)
        before = (len(emitted), accepted, last is None)
        if last is None:
            yield Prefill(emitted[0], t - t0, scores=scores)
            if len(emitted) > 1:  # the round that came with it (drafted 0: a plain step's one token)
                yield Round(drafted, accepted, list(emitted[1:]), 0.0, None, with_first=True)
        else:
            yield Round(drafted, accepted, list(emitted), t - last, None, scores=scores)
        last = t


def check_step(arm: External, t: float, before: float, emitted, drafted, accepted, first: bool) -> None:
    """ArmReportError naming `arm` and the offending value unless the step is possible: integral
    ids in [0, vocabulary), 0 <= accepted <= drafted integers, no more tokens than the accepted
    drafts and a bonus, and an arrival time not before the previous one."""
    vocab = arm.target.vocab_size
    bad = next((x for x in emitted if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab), None)
    if not emitted or bad is not None:
        raise ArmReportError(f"{arm.who()} returned token id {bad!r}, outside the target's vocabulary [0, {vocab}) "
                             f"(step {list(emitted)[:8]})")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (drafted, accepted)) \
            or not 0 <= accepted <= drafted:
        raise ArmReportError(f"{arm.who()} reported accepted={accepted!r} of drafted={drafted!r}: counts must be "
                             "integers with 0 <= accepted <= drafted")
    if len(emitted) - (1 if first else 0) > accepted + 1:
        raise ArmReportError(f"{arm.who()} emitted {len(emitted)} tokens in a step that accepted {accepted} drafts "
                             "(at most the accepted drafts and one bonus token)")
    if t < before:
        raise ArmReportError(f"{arm.who()}: a step arrived {before - t:.6f}s before the previous one")


def check_uncut(arm: External, step: int, n_emitted: int, accepted: int, first: bool) -> None:
    """ArmReportError naming `arm` unless a step that was not a generation's last (so neither the
    budget nor a stop token cut it) emitted its accepted drafts and one token more: accepted + 1
    tokens, or on the first step also its prefill token before them (accepted + 2). Else its
    counts contradict its tokens, and acceptance would read what it claimed, not what it emitted."""
    if n_emitted == accepted + 1 or (first and n_emitted == accepted + 2):
        return
    expected = f"{accepted + 1}" + (f", or {accepted + 2} with the first token before them" if first else "")
    raise ArmReportError(
        f"{arm.who()} emitted {n_emitted} token(s) in step {step + 1}, which reported accepted={accepted}, and more "
        f"steps followed: a step that no budget or stop token cut emits its accepted drafts and one token more "
        f"({expected}). Fix: report on each line the drafted/accepted counts of the round whose tokens it "
        "carries, or leave them out")


def _events(responses, t0: float, arm: Engine):
    """stamped_events over (tokens emitted, tokens drafted, scores) per step, each stamped as it
    arrives, all but the bonus token of a step accepted."""
    return stamped_events(((time.perf_counter(), e, d, len(e) - 1, s) for e, d, s in responses), t0, arm)


def refuse_cast_kv(target, arm: str) -> None:
    """Unsupported for a float16/bfloat16 KV cache, which mlx-lm's loops cannot store."""
    if target.kv in ("float16", "bfloat16"):
        raise Unsupported(f"mlx-lm has no {target.kv} KV storage option; pair {arm} with kv=native, q8 or q4")


def kv_quantization(target) -> dict:
    """mlx-lm's generate-step arguments that quantize its KV cache as the cell's kv=q8/q4 does."""
    if target.kv not in ("q8", "q4"):
        return {}
    return {"kv_bits": int(target.kv[1:]), "kv_group_size": target.kv_group_size, "quantized_kv_start": 0}


class MlxLm(External):
    """mlx-lm's generate_step with the cell's sampler, prompt ids and KV quantization."""

    name = "mlx_lm"
    scores = True  # generate_step yields each token's log-probabilities

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        refuse_cast_kv(target, "mlx_lm")

    def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        self._caches = make_prompt_cache(self.target.model)
        pos = itertools.count()  # its sampler is called once per output position, in order (and once past the end)
        pick = lambda logprobs: sampler.choose(logprobs, next(pos))
        t0 = time.perf_counter()
        steps = generate_step(mx.array(prompt), self.target.model, max_tokens=max_new_tokens, sampler=pick,
                              prompt_cache=self._caches, **kv_quantization(self.target))

        def tokens():
            for tok, logprobs in steps:
                yield [tok], 0, logprobs
                if tok in stop_tokens:
                    return

        yield from _events(tokens(), t0, self)

    def describe(self):
        from importlib.metadata import version

        return {"implementation": "mlx_lm.generate.generate_step", "version": version("mlx-lm"),
                "cache_types": sorted({type(c).__name__ for c in self.target.cache})}


class MlxLmSpec(External):
    """mlx-lm's speculative_generate_step: the cell's draft model drafts block_size - 1 tokens
    per round; mlx-lm accepts a draft when the target's own choice there equals it."""

    name = "mlx_lm_spec"
    knobs = ("block_size", "drafter")
    drafter_kind = "draft_model"
    scores = True

    def __init__(self, target, cfg):
        from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

        from engines.drafters.draft_model import load_draft_model  # mlx-lm's cache: loaded by this arm only
        from engines.methods.draft_model import DEFAULT_BLOCK_SIZE

        super().__init__(target, cfg)
        refuse_cast_kv(target, "mlx_lm_spec")
        self.draft_model, self.config = load_draft_model(Path(cfg.drafter), target)
        self.k = (cfg.block_size or DEFAULT_BLOCK_SIZE) - 1
        self.block = self.k + 1
        fresh = make_prompt_cache(target.model) + make_prompt_cache(self.draft_model)
        if not can_trim_prompt_cache(fresh):
            kinds = sorted({type(c).__name__ for c in fresh if not c.is_trimmable()})
            raise Unsupported(f"mlx-lm's speculative decoding needs trimmable caches; this pair has {', '.join(kinds)}")
        if any(isinstance(c, RotatingKVCache) for c in fresh):
            raise Unsupported("mlx-lm's speculative_generate_step fails on sliding-window caches once their window "
                              "is full (a broadcast error in the verify's attention mask); no pair with one runs")

    def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
        from mlx_lm.generate import speculative_generate_step
        from mlx_lm.models.cache import make_prompt_cache

        self._caches = make_prompt_cache(self.target.model) + make_prompt_cache(self.draft_model)
        t0 = time.perf_counter()
        # Its sampler sees the draft model's and the target's rows alike, so positions cannot key
        # the noise: greedy is exact, and T > 0 draws with MLX's global generator.
        pick = (lambda lp: mx.argmax(lp, axis=-1)) if sampler.temperature == 0 else \
            (lambda lp: mx.random.categorical(lp / sampler.temperature))
        steps = speculative_generate_step(mx.array(prompt), self.target.model, self.draft_model,
                                          num_draft_tokens=self.k, max_tokens=max_new_tokens, sampler=pick,
                                          prompt_cache=self._caches, **kv_quantization(self.target))
        yield from _events(self._rounds(steps, stop_tokens, max_new_tokens), t0, self)

    def _rounds(self, steps, stop_tokens, max_new_tokens):
        # Its tokens arrive one by one, flagged from_draft; a target token closes each verify.
        group, n = [], 0
        for tok, logprobs, from_draft in steps:
            group.append(int(tok))
            n += 1
            if tok in stop_tokens or not from_draft or n == max_new_tokens:
                yield group, min(self.k, max_new_tokens - (n - len(group))), logprobs if len(group) == 1 else None
                if tok in stop_tokens:
                    return
                group = []

    def describe(self):
        from importlib.metadata import version

        return {"implementation": "mlx_lm.generate.speculative_generate_step", "version": version("mlx-lm"),
                "k": self.k, "drafter_model_type": self.config.get("model_type"),
                "observed": "tokens and from_draft flags per token: accepted = drafts emitted in a verify; drafted "
                            "= its num_draft_tokens cut at the budget; log-probabilities for one-token rounds only",
                "cache_types": sorted({type(c).__name__ for c in self.target.cache})}


class DFlashZlab(External):
    """z-lab's MLX DFlash `stream_generate`, on the cell's target and drafter directories. What
    it patches in the target, and what the arm patches in it, engines/runtime/patches.py undoes."""

    name = "dflash_zlab"
    knobs = ("block_size", "drafter")
    drafter_kind = "dflash"

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        try:
            import dflash.model_mlx as zlab
        except ImportError:
            raise Unsupported(f"z-lab's dflash reference is not installed: {ANCHORS_INSTALL}") from None
        if target.kv != "native":
            raise Unsupported("z-lab's dflash reference has no KV dtype option; pair it with kv=native")
        self.zlab = zlab
        self.drafter = _load_zlab_drafter(zlab, Path(cfg.drafter))
        self.block = cfg.block_size or int(self.drafter.config.block_size)

    def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
        tokenizer = copy.copy(self.tokenizer)
        tokenizer.eos_token_ids = stop_tokens  # generations run to max_new_tokens like every other arm
        t0 = time.perf_counter()
        model = self.target.model
        with zlab_layers_restored(model, decoder(model).layers), self._recording_caches():
            responses = self.zlab.stream_generate(self.target.model, self.drafter, tokenizer, mx.array(prompt),
                                                  block_size=self.block, max_tokens=max_new_tokens,
                                                  temperature=sampler.temperature)
            yield from _events(self._rounds(responses, max_new_tokens), t0, self)

    def _rounds(self, responses, max_new_tokens):
        n = 0
        for r in responses:
            if not r.tokens:
                continue  # the closing response carries no tokens
            # Not returned: its drafted count follows from its loop (a block of min(block, tokens left + 1)).
            drafted = min(self.block, max_new_tokens - n + 1) - 1 if n else 0
            n += len(r.tokens)
            yield r.tokens, drafted, None

    @contextmanager
    def _recording_caches(self):
        # Its caches are local to stream_generate: keep the ones it makes, for the memory record.
        self._caches = []

        def recording(original):
            def make(model, *args, **kw):
                out = original(model, *args, **kw)
                self._caches += out
                return out
            return make

        with zlab_make_prompt_cache(self.zlab, recording):
            yield

    def describe(self):
        from importlib.metadata import version

        c = self.drafter.config
        return {"implementation": "dflash.model_mlx.stream_generate", "version": version("dflash"),
                "observed": "tokens per verify only: drafted = its block size cut at the budget (from its "
                            "loop), accepted = tokens - 1 (the last round's is unknown when the budget cuts it); "
                            "no logits, so divergence margins are unavailable",
                "block_size": self.block, "drafter_layers": c.num_hidden_layers,
                "target_layer_ids": list(c.target_layer_ids)}


def _load_zlab_drafter(zlab, path: Path):
    # Its loader resolves a hub id through snapshot_download; hand it the local directory instead.
    local = lambda repo_id, **kw: str(repo_id)
    with zlab_snapshot_download(zlab, lambda _: local):
        return zlab.load_draft(str(path))
