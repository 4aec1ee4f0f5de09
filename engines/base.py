"""The engine protocol (engines/registry.py finds an engine by name).

An engine is one speculative-decoding method. It sees token ids only, never text,
and never times, prints or loops over the output: harness/loop.py drives it one
round at a time and does acceptance there, for every engine the same way.

One round, as the loop runs it:

    draft = engine.draft(history)                    # propose K ids (device)
    logits = engine.verify(pending, draft)           # one target forward over
                                                     #   [pending] + draft.tokens
    outcome = accept(draft, logits, sampler)         # loop-side, shared, on the device
    n, emitted = read(outcome)                       # the round's one host read
    engine.rollback(n, draft)                        # keep pending + n drafts

`history` is prompt + output so far; its last token ("pending") has been chosen
but not yet fed to the target. Each method states below what state every call
leaves behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx

from engines.kernels.deltanet import backend_path
from engines.runtime.forced import Force
from engines.runtime.target import Forward, Target, as_ids


@dataclass
class Draft:
    """A proposed continuation.

    tokens: [K] int32 ids that would follow the pending token, K >= 0 (a list is
       converted; a device array stays lazy, so drafting never waits on the host).
    q: [K, V] drafter probabilities the tokens were sampled from, or None for a
       deterministic proposal (n-gram, greedy drafters): then acceptance compares
       each token with the target's own choice at that position.
    """

    tokens: mx.array = field(default_factory=lambda: mx.zeros((0,), dtype=mx.int32))
    q: mx.array | None = None
    # A tree instead of a chain: parents[i] is the index of node i's parent (-1 = the
    # pending token). The loop then accepts a path and stores it in accepted_path.
    parents: list[int] | None = None
    accepted_path: list[int] | None = None

    def __post_init__(self):
        self.tokens = as_ids(self.tokens)

    @property
    def k(self) -> int:
        return self.tokens.shape[0]


# What a generation yields, in order: one Prefill, then one Round per verify (harness/loop.py's
# generate for the harness's engines, engines/arms/external.py's stamped_events for the others).

@dataclass
class Prefill:
    """The first token of a generation (the loop's first event, or an external arm's)."""

    token: int  # first output token, chosen from the prompt's last logits
    seconds: float  # time to first token: the target's prefill plus the method's prepare() over the prompt
    phases: dict[str, float] | None = None  # {"prefill", "prepare"} seconds when profiling
    scores: mx.array | None = None  # [V] the arm's own log-probabilities here, where an external arm gives them


@dataclass
class Round:
    """One round after the first token: a verify, or a decode step where nothing was drafted."""

    drafted: int  # K tokens proposed (for a tree: its depth, the longest path it could accept)
    accepted: int  # n of them the target accepted (even where the budget or a stop token cuts emitted)
    emitted: list[int]  # accepted drafts + bonus, cut at the token budget or a stop token (so it can hold
    #                     fewer than accepted + 1)
    seconds: float
    phases: dict[str, float] | None  # per-phase seconds when profiling, else None
    tree_size: int = 0  # nodes in the draft tree (0 for chains)
    scores: mx.array | None = None  # [V] log-probabilities of a one-token round, where an external arm gives them
    with_first: bool = False  # arrived with the first token (an outside loop's first round): its time is in
    #                           the time to first token, so its tokens are not decode tokens
    host: dict[str, float] | None = None  # per-phase seconds the host spent before the phase's barrier
    #                                       (building its graph, and any reads inside it), when profiling
    reads: int | None = None  # host reads the loop made for this round (None: an outside loop's, unseen)
    ahead: bool = False  # the next round was queued before this one was read (pipelined, or on the device)


class NullProfiler:
    """Phase marks cost nothing unless the harness installs a real profiler."""

    enabled = False

    def mark(self, phase: str, *arrays) -> None:
        pass


class Engine:
    """Base class: target-only behaviour that most methods share.

    Contract (what each call leaves behind):
    - prefill(prompt) -> logits [V] at the last prompt position. The target cache
      (and any drafter state) covers exactly the prompt.
    - prepare(prompt + [first token]): the method's own work over the prompt before
      its first draft (a drafter's context pass), once, timed as part of the first
      token; optional (a method that skips it does that work in its first draft).
      Returns any array it computed outside its caches (the loop evaluates it), or None.
    - draft(history) -> Draft of the method's full K tokens, every round: the loop
      cuts the emitted tokens at the generation's budget, so the last rounds keep
      the shapes of all others (new shapes recompile kernels on GPU backends). An
      engine whose drafts cost one step each declares `caps_drafts` and drafts at
      most self.max_drafts (>= 1), which the loop sets before each draft to what the
      budget can still use, as mlx-lm's speculative loop does. The target cache is
      unchanged; drafter state may advance, as long as rollback() can put it back.
    - verify(pending, draft) -> logits [K+1, V] for [pending] + draft.tokens, fed
      in one target forward; the target cache now covers them all. pending is a
      [1] int32 array (possibly not yet computed: base decoding pipelines on it).
    - rollback(n_accepted, draft) keeps pending + the first n_accepted drafts in
      every cache and drops the rest, exactly, or raises RollbackError.
    - describe() -> dict of facts for the record (e.g. which rollback path ran).

    An engine that reads the target's hidden states (a drafter conditioned on them) says which
    layers in hidden_layers(cfg, model); its Target is built to keep them (build() does so),
    and it reads them from the Forward that the target call which fed those tokens returns.
    """

    name: ClassVar[str] = ""  # the key engines/registry.py lists this class under
    knobs: ClassVar[tuple[str, ...]] = ()  # MethodConfig fields this method reads
    # Settings of this method alone, name -> default (a bool, int, float or str): set as method.options.<name>,
    # checked against the default's type, and part of the cell where set away from the default
    options: ClassVar[dict[str, Any]] = {}
    drafts: ClassVar[bool] = True  # False: every round is one decode step (the loop pipelines them)
    external: ClassVar[bool] = False  # True: someone else's generation loop (engines/arms/external.py)
    incremental_verify: ClassVar[bool] = True  # False: verify is not the target's incremental one (re-prefill)
    verifies_full_block: ClassVar[bool] = False  # True: every round verifies K+1 tokens whatever it drafted
    scores: ClassVar[bool] = False  # True: an external arm that yields its own log-probabilities per token
    caps_drafts: ClassVar[bool] = False  # True: draft() stops at self.max_drafts, set by the loop each round
    execution: ClassVar[str] = "eager"  # "static": rounds stay on the device (engines/methods/device.py)
    adapts_drafts: ClassVar[bool] = False  # True: draft() honours method.draft_threshold (adaptive draft length)
    bandit_drafts: ClassVar[bool] = False  # True: draft() honours method.draft_bandit (K picked each round)

    def __init__(self, target: Target, cfg):
        self.target, self.cfg = target, cfg
        self.prof = NullProfiler()
        self.sampler = None  # set by the loop before prefill (temperature, seeded streams)
        self.max_drafts: int | None = None  # set by the loop before each draft where caps_drafts
        self.opt = self.option_values(cfg)  # this method's own settings (method.options over Engine.options)
        self.force = Force.from_config(getattr(cfg, "force", None))  # a chosen acceptance (engines/runtime/forced.py)
        # tokens a full round feeds the verify (K + 1): method.block_size where the method takes one, 1 where it
        # does not draft; a method whose block comes from elsewhere (its drafter, its tree) sets it in __init__
        self.block: int = (getattr(cfg, "block_size", None) if "block_size" in self.knobs else None) or 1

    @classmethod
    def option_values(cls, cfg) -> dict[str, Any]:
        """The method's options: its declared defaults, with those method config `cfg` sets over them
        (harness/config.validate has refused names it does not declare and values of another type)."""
        given = getattr(cfg, "options", None) or {}
        return {name: given.get(name, default) for name, default in cls.options.items()}

    @classmethod
    def hidden_layers(cls, cfg, model) -> tuple[int, ...]:
        """The target layers whose outputs this method reads from target forwards (Forward.hidden),
        for method config `cfg` (read from its drafter's config, not its weights) on the loaded
        target `model`; its Target must be built with Target(..., hidden_layers=these). () for a
        method that reads none. May raise DrafterError, as loading the drafter would."""
        return ()

    @classmethod
    def build(cls, model, cfg, **target_kw) -> "Engine":
        """This engine over a fresh Target of `model` that keeps the layers it reads;
        target_kw are the Target's other settings (kv, rollback, kv_group_size, dispatch)."""
        return cls(Target(model, hidden_layers=cls.hidden_layers(cfg, model), **target_kw), cfg)

    def _check_hidden_layers(self, layers: tuple[int, ...]) -> None:
        # Called by an engine that reads hidden states, once its drafter is loaded.
        cls = type(self).__name__
        if self.target.hidden_layers != tuple(layers):
            raise ValueError(f"{cls} reads the target's layers {tuple(layers)}, but its Target keeps "
                             f"{self.target.hidden_layers}: build it with {cls}.build(model, cfg) or "
                             f"Target(model, hidden_layers={cls}.hidden_layers(cfg, model))")

    def prefill(self, prompt: list[int]) -> mx.array:
        return self.target.prefill(prompt).logits

    def prepare(self, history: list[int]) -> mx.array | None:
        return None  # what it computed outside the caches, for the loop's barrier

    def draft(self, history: list[int]) -> Draft:
        return Draft()

    def verify(self, pending: mx.array, draft: Draft) -> mx.array:
        return self.target_verify(mx.concatenate([pending, draft.tokens]) if draft.k else pending).logits

    def target_verify(self, tokens: mx.array) -> Forward:
        """One batched target forward, or one per token when the method asks for
        verify=sequential (single-token decode numerics, T forwards); logits [T, V] and
        hidden [1, T, n * H] (None where the Target keeps no layers)."""
        if self.cfg.verify == "sequential":
            return self.target.verify_sequential(tokens)
        return self.target.verify(tokens)

    def rollback(self, n_accepted: int, draft: Draft) -> None:
        self.target.commit(n_accepted + 1)

    def use_prefix(self, prefix) -> None:
        """Restore `prefix` (an engines/runtime/prefix.PrefixCache, or None) in every prefill of a prompt
        that starts with it, in the target and in any drafter model with a cache of its own."""
        self.target.prefix = prefix

    def close(self) -> None:
        """Release what the engine holds outside this process (an outside engine's process)."""

    def caches(self) -> list:
        """Every cache object this engine owns: the target's, then any drafter's."""
        return list(self.target.cache)

    def state(self) -> list:
        """Every array of every cache this engine owns (for mx.eval barriers)."""
        return [c.state for c in self.caches()]

    def describe(self) -> dict:
        out = {"rollback": self.target.strategy if self.target.layout.recurrent else "trim",
               "cache_types": sorted(set(self.target.layout.types)),
               "verify": self.cfg.verify,
               "dispatch": {"stage_every": self.target.stage_every, "stable_attention": self.target.stable_attention,
                            "small_m_gemm": self.target.small_m_gemm}}
        if self.target.layout.recurrent:
            out["recurrence"] = backend_path()
        return out
