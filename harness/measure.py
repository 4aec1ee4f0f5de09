"""Measuring one cell: the method arm and the base arm, interleaved prompt by prompt.

Protocol per cell:
1. warm-up: `warmup` untimed generations of each arm on the first prompt (first
   calls compile kernels); on GPUs also a short one on every later prompt (its prefill
   shapes), and a full one where the timed runs would reach a key bucket (mlx-lm's cache
   step) that no earlier warm-up reached: a new bucket brings new attention plans;
2. calibration: on the first prompt's context, the target's cost of one decode
   step and of one verify over K+1 tokens (median of a few), for the speedup model;
   on hybrid targets the cost of each recurrent rollback strategy, weighted by the
   accepted counts of the method's warm-up rounds (rollback=auto takes the fastest,
   then warms up once more if that changed the strategy); the verify cost at a 4x
   longer context;
3. per prompt, `reps` timed generations of both arms side by side, the order
   alternating (method_first) and recorded, the allocator's cache emptied before each
   arm (optional cool-down between reps); each records its arm's time to first token
   (prefill plus the method's prompt-side prepare()), decode and end-to-end tok/s,
   peak device memory and cache bytes, and a rep slower than a third of its arm's
   median on that prompt is flagged as an outlier;
4. with bench.profile, one more generation of each arm with per-phase barriers; they
   feed the phase profile and the speedup model only, never tok/s. The model's unit
   is that profiled base step, measured next to the method's profiled rounds with
   the same barriers, so its cost ratios are side by side like the speedups.
The reference arm's first output is the reference for divergence; where a method
leaves it, the reference's own scores there are inspected (top-1/top-2 margin) to tell
numerical near-ties from bugs (divergence_margin says where the scores come from).

This module runs the protocol; its parts live beside it: one generation and its record
fields in harness/generation.py, calibration in harness/calibrate.py, divergence margins in
harness/divergence.py, the summary and speedup model (plain numbers, no MLX) in
harness/summary.py.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.base import Engine
from engines.runtime.prefix import PrefixStore
from engines.runtime.sampling import Sampler
from harness import context as contexts
from harness.bounds import fit_prompt, verify_sizes
from harness.calibrate import calibrate, compare_rollbacks, context_scaling
from harness.divergence import divergence, divergence_margin
from harness.generation import Generation, first_token_ms, round_table, run_generation, timings
from harness.heartbeat import HEARTBEAT
from harness.prompts import Prompt, encode_turn
from harness.summary import also_summary, cell_summary, speedup_model


@dataclass
class Arms:
    method: Engine
    base: Engine | None  # the reference arm (base decoding unless cfg.reference says otherwise); None if
    #                      the method is the reference itself
    block: int = 1  # tokens the method verifies per full round (K + 1)
    reference_is_base: bool = True  # False when paired against another method (the model's unit is base)
    rollback_auto: bool = False  # rollback=auto: switch both arms to the fastest measured strategy
    also: Engine | None = None  # a second reference timed in the same reps (also_against: what users run)

    def engines(self) -> list[Engine]:
        return [self.method] + ([self.base] if self.base else []) + ([self.also] if self.also else [])


def method_first(unit: int, rep: int) -> bool:
    """Whether the method arm runs before the reference in rep `rep` of prompt (turn) `unit`:
    alternating over reps (AB BA AB ...) and over prompts, so an order effect (a warm or cold
    cache, allocator state, clock boost) is paid by both arms alike and cancels in the
    geometric mean of the paired ratios."""
    return (unit + rep) % 2 == 0


def measure_cell(arms: Arms, tokenizer, prompts: list[Prompt], bench, progress=None,
                 context: int | None = None, log=None) -> dict:
    """Run every prompt (and turn) of the cell; returns the record's per-prompt list and summary.
    `context`: the model's positions; every prompt is checked against it before anything runs
    (ConfigError), or cut to fit with bench.truncate_prompts. `log` hears each phase begin."""
    cell = CellRun(arms, tokenizer, bench, context, log or (lambda msg: None))
    units = [(p, t) for p in prompts for t in range(len(p.turns))]
    HEARTBEAT.log = cell.log
    try:
        check_prompts(units, tokenizer, bench, arms.block, context, cell.ctx)
        for u, (prompt, turn) in enumerate(units):
            cell.measure_unit(u, prompt, turn, len(units))
            if progress:
                progress(u + 1, len(units))
    finally:
        HEARTBEAT.log = None
        for eng in arms.engines():
            eng.use_prefix(None)
    return cell.result()


class CellRun:
    """One cell's state while it runs: what each prompt (turn) adds to, phase by phase."""

    def __init__(self, arms: Arms, tokenizer, bench, context: int | None, log):
        self.arms, self.tokenizer, self.bench, self.context, self.log = arms, tokenizer, bench, context, log
        self.sampler = Sampler(bench.temperature, bench.seed)
        self.stop = frozenset(tokenizer.eos_token_ids) if bench.stop_at_eos else frozenset()
        self.ctx = contexts.build(tokenizer, bench.context, bench.context_source, bench.chat_template)
        self.items: list[dict] = []
        self.reps_m, self.reps_b = [[] for _ in range(bench.reps)], [[] for _ in range(bench.reps)]
        self.reps_a = [[] for _ in range(bench.reps)]  # the second reference's (arms.also), when there is one
        self.answers: dict[str, list[str]] = {}  # the reference's answers, for later turns of a prompt
        self.calibration, self.cell_context, self.prefix, self.warm = None, None, None, None
        self.warm_every = warmup_every_prompt(bench)
        self.warmed_keys = 0  # the longest context a warm-up of this cell has reached
        self.wall = WallClock()

    def prompt_ids(self, prompt: Prompt, turn: int) -> tuple[list[int], list[int] | None, int | None]:
        """(ids, the context's ids inside them or None, the length before a cut or None); the first
        prompt with a context hands every arm its prefix (system turn + context) to restore."""
        answers = self.answers.get(prompt.id, [])
        ids = encode_turn(self.tokenizer, prompt, turn, answers, self.bench.chat_template,
                          self.ctx.messages if self.ctx else ())
        placed = None
        if self.ctx:
            start, end = _context_span(self.tokenizer, prompt, turn, answers, self.bench, ids)
            placed = ids[start:end]
            if self.bench.context_reuse and self.prefix is None:  # the same for every prompt of the cell
                self.prefix = PREFIXES.get(ids[:end])
                for eng in self.arms.engines():
                    eng.use_prefix(self.prefix)
        ids, cut_from = fit_prompt(ids, self.bench.max_new_tokens, self.arms.block, self.context,
                                   _where(prompt, turn, self.ctx), self.bench.truncate_prompts)
        return ids, placed, cut_from

    def measure_unit(self, u: int, prompt: Prompt, turn: int, n_units: int) -> None:
        """Warm-up (first prompt, or every prompt on GPUs), calibration (first prompt), the timed
        reps, the profiled runs and the prompt's record item."""
        bench, arms = self.bench, self.arms
        ids, placed, cut_from = self.prompt_ids(prompt, turn)

        def run(eng, profile=False, keep_scores=False, max_new_tokens=bench.max_new_tokens):
            return run_generation(eng, ids, max_new_tokens, self.sampler, profile, self.stop, keep_scores)

        if u == 0 or self.warm_every:
            self.warm_up(u == 0, _where(prompt, turn), run, len(ids))
        if u == 0:
            self.calibrate(ids, run)
        HEARTBEAT.start(f"the timed reps of {_where(prompt, turn)} (turn {u + 1}/{n_units})")
        with self.wall("timed_reps"), gc_paused():
            gm, gb, ga, order = _timed_reps(arms, run, u, bench)
        for reps, gens in ((self.reps_m, gm), (self.reps_b, gb), (self.reps_a, ga)):
            for r, g in enumerate(gens):
                reps[r].append(g.tally())
        ref = gb[0] if arms.base else gm[0]
        self.answers.setdefault(prompt.id, []).append(self.tokenizer.decode(ref.tokens))
        HEARTBEAT.start(f"the profiled runs of {_where(prompt, turn)}")
        with self.wall("profile"):
            prof = run(arms.method, profile=True) if profiled(bench, u) else None
            bprof = run(arms.base, profile=True) if prof and arms.base and arms.reference_is_base else None
        item = _prompt_item(prompt, turn, ids, gm, gb, prof)
        item["arm_order"] = order
        if ga:
            item["also"] = {**timings(ga), **divergence(ga[0].tokens, (gb or gm)[0].tokens)}
        if placed is not None:
            item.update(context_tokens=len(placed), context_sha256=contexts.ids_sha256(placed))
            self.cell_context = self.cell_context or contexts.describe(self.ctx, placed)
        if cut_from is not None:
            item["truncated_from"] = cut_from  # prompt tokens before bench.truncate_prompts kept the last ones
        if bprof:
            item["base_profile"] = {"rounds_detail": round_table(bprof), "first_token": first_token_ms(bprof)}
        if item["first_divergence"] is not None:
            with self.wall("divergence"):
                item["divergence"] = divergence_margin(arms.base or arms.method, ref, ids, gm[0].tokens,
                                                       item["first_divergence"])
        self.items.append(item)

    def warm_up(self, first: bool, where: str, run, n_ids: int) -> None:
        HEARTBEAT.start(f"the warm-up of {where}")
        reach = n_ids + self.bench.max_new_tokens + self.arms.block  # keys the timed runs may hold
        with self.wall("warmup"):
            if first:
                self.log(f"  warm-up: {self.bench.warmup} generation(s) per arm")
                self.warm = _warm_up(self.arms, run, self.bench.warmup)
            elif self.bench.warmup and key_bucket(reach) > key_bucket(self.warmed_keys):
                self.log(f"  warm-up: {where} reaches {reach} keys, a bucket past the {self.warmed_keys} warmed so far:"
                         f" a full generation per arm")
                _warm_up(self.arms, run, min(self.bench.warmup, 1))
            else:  # later prompts bring new shapes (their prefill), not new code: a short generation compiles them
                short = _later_warmup_tokens(self.bench, self.arms.block)
                _warm_up(self.arms, lambda eng: run(eng, max_new_tokens=short), min(self.bench.warmup, 1))
                reach = n_ids + short + self.arms.block
        if self.bench.warmup:
            self.warmed_keys = max(self.warmed_keys, reach)

    def calibrate(self, ids: list[int], run) -> None:
        self.log(f"  calibration: verify of {len(verify_sizes(self.arms.block))} sizes up to {self.arms.block} tokens")
        HEARTBEAT.start("the calibration")
        with self.wall("calibrate"):
            self.calibration = _calibrate_cell(self.arms, ids, self.sampler, self.warm, self.context,
                                               scaling=not self.ctx)
            if self.calibration.get("rollback", {}).get("switched"):
                _warm_up(self.arms, run, min(self.bench.warmup, 1))  # the chosen strategy's shapes, before timing

    def result(self) -> dict:
        """The record's prompts, calibration, summary (with the speedup model), wall and context."""
        arms = self.arms
        summary = cell_summary(self.items, self.reps_m, self.reps_b if arms.base else None)
        if arms.also:
            summary["also"] = {"against": arms.also.name, **also_summary(self.items, self.reps_m, self.reps_a)}
        summary["verify_cost_ratio"] = self.calibration["verify_cost_ratio"]  # verify of a full block / one decode step
        summary["model"] = speedup_model(self.items, summary, self.calibration, arms.block,
                                         arms.method.incremental_verify, arms.method.verifies_full_block)
        out = {"prompts": self.items, "calibration": self.calibration, "summary": summary, "wall": self.wall.seconds}
        if not self.cell_context:
            return out
        if self.prefix is not None:
            self.cell_context["prefix_reuse"] = {"tokens": len(self.prefix.prefix), "fed_this_process": self.prefix.fed,
                                                 "restored": self.prefix.restored, "snapshot_bytes": self.prefix.nbytes()}
        return {**out, "context": self.cell_context}


PREFIXES = PrefixStore()  # one prefix's snapshots kept across the cells of a sweep (engines/runtime/prefix.py)


class WallClock:
    """Seconds spent per part of a cell (`with clock("part"): ...`), summed over the cell."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = round(self.seconds.get(part, 0.0) + time.perf_counter() - t0, 3)


def profiled(bench, unit: int) -> bool:
    """Whether prompt (turn) `unit` gets the profiled runs: every bench.profile_every-th turn."""
    return bool(bench.profile) and unit % max(1, bench.profile_every) == 0


KEY_BUCKET = KVCache.step  # mlx-lm grows a cache's buffer this many keys at a time


def key_bucket(keys: int) -> int:
    """Which of mlx-lm's cache buffer sizes `keys` keys fall in: attention plans (cuDNN on CUDA,
    engines/runtime/dispatch.py's shape-stable attention) are made per buffer size."""
    return -(-keys // KEY_BUCKET)


def _later_warmup_tokens(bench, block: int) -> int:
    # Enough tokens for a prompt's prefill and its first few rounds (bench.warmup_tokens overrides).
    return min(bench.max_new_tokens, bench.warmup_tokens or max(8, 2 * block))


def _warm_up(arms: Arms, run, n: int) -> Generation | None:
    # Untimed generations of each arm; returns the method's last (its acceptance weights rollback choice).
    last = None
    for _ in range(n):
        last = run(arms.method)
        if arms.base:
            run(arms.base)
        if arms.also:
            run(arms.also)
    return last


@contextmanager
def gc_paused():
    """Python's cyclic collector off inside, its earlier state restored after (as timeit does).

    A full collection over a loaded harness takes ~50 ms on a 2-core CPU, as long as a third of
    a short timed rep: left on, it lands in whichever rep crosses its allocation threshold. The
    collection that is due runs after the reps instead (no collection up front: per prompt that
    would cost a cell of 36 prompts seconds)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _timed_reps(arms: Arms, run, unit: int, bench) -> tuple[list[Generation], list[Generation], list[Generation],
                                                           list[str]]:
    # Per rep, every arm side by side, the allocator's cache emptied before each so none inherits
    # another's buffers. Two arms alternate (AB BA ...: "mb" or "bm"); with a second reference the
    # three rotate (mba bam amb ...), so each arm takes each place as often.
    gens = {"m": [], "b": [], "a": []}
    keep = arms.base is not None and arms.base.scores  # the reference's own scores, for divergence margins
    engines = {"m": arms.method, "b": arms.base, "a": arms.also}
    order = []
    for r in range(bench.reps):
        if r and bench.cooldown_s:
            time.sleep(bench.cooldown_s)
        turn = arm_order(unit, r, arms)
        for arm in turn:
            mx.clear_cache()
            gens[arm].append(run(engines[arm], keep_scores=keep and r == 0) if arm == "b" else run(engines[arm]))
        order.append(turn)
    return gens["m"], gens["b"], gens["a"], order


def arm_order(unit: int, rep: int, arms: Arms) -> str:
    """The arms of rep `rep` of prompt (turn) `unit` in the order they run: m(ethod), b(ase: the
    reference), a(lso: the second reference)."""
    if arms.base is None:
        return "m"
    if arms.also is None:
        return "mb" if method_first(unit, rep) else "bm"
    turn = "mba"
    k = (unit + rep) % 3
    return turn[k:] + turn[:k]


def check_prompts(units, tokenizer, bench, block: int, context: int | None,
                  ctx: contexts.Context | None = None) -> None:
    """ConfigError for the first prompt (turn) that cannot fit the model's context with the
    token budget (and bench.context's earlier conversation), before anything runs. A later
    turn is charged its earlier answers at max_new_tokens each (their exact length is known
    only once they are generated)."""
    if context is None:
        return
    for prompt, turn in units:
        ids = encode_turn(tokenizer, prompt, turn, [""] * turn, bench.chat_template, ctx.messages if ctx else ())
        fit_prompt([0] * (len(ids) + turn * bench.max_new_tokens), bench.max_new_tokens, block, context,
                   _where(prompt, turn, ctx), bench.truncate_prompts, "lower bench.context" if ctx else "")


def _where(prompt: Prompt, turn: int, ctx: contexts.Context | None = None) -> str:
    where = f"prompt {prompt.id!r}" + (f" turn {turn + 1}" if len(prompt.turns) > 1 else "")
    return where + (f" after bench.context={ctx.requested} tokens of earlier conversation" if ctx else "")


def _context_span(tokenizer, prompt: Prompt, turn: int, answers: list[str], bench, ids: list[int]) -> tuple[int, int]:
    # Where the context's own ids sit in this prompt's: the record's proof that every prompt, arm and rep read the same.
    return contexts.span(ids, encode_turn(tokenizer, prompt, turn, answers, bench.chat_template))


def _calibrate_cell(arms: Arms, ids: list[int], sampler: Sampler, warm: Generation | None,
                    context: int | None = None, scaling: bool = True) -> dict:
    target = arms.method.target
    rollbacks = None
    if target.layout.recurrent and arms.block > 1:
        hist = warm.acceptance()["accept_hist"] if warm and warm.rounds else None
        rollbacks = compare_rollbacks(target, ids, arms.block, hist)
        if arms.rollback_auto:
            rollbacks["switched"] = rollbacks["fastest"] != target.strategy
            for eng in arms.engines():
                eng.target.set_strategy(rollbacks["fastest"])
    calibration = calibrate(target, ids, arms.block)
    if rollbacks:
        calibration["rollback"] = rollbacks
    if not scaling:  # bench.context is the axis that measures this, cell by cell
        calibration["context_scaling"] = {"skipped": "bench.context > 0: cells along bench.context measure it"}
    elif arms.block > 1 and not arms.method.external:
        calibration["context_scaling"] = context_scaling(arms.method, ids, sampler, context=context, block=arms.block)
    return calibration


def warmup_every_prompt(bench) -> bool:
    """GPU backends JIT-compile kernels per shape, and every prompt brings new shapes:
    warm up on each prompt there; on the CPU the first prompt suffices."""
    if bench.warmup_scope == "auto":
        return mx.default_device().type != mx.cpu
    return bench.warmup_scope == "every"


def _prompt_item(prompt: Prompt, turn: int, ids, gm: list[Generation], gb: list[Generation],
                 prof: Generation | None) -> dict:
    g = gm[0]
    ref = gb[0].tokens if gb else g.tokens
    item = {"id": prompt.id, "category": prompt.category, "suite": prompt.suite, "turn": turn, "prompt_tokens": len(ids),
            "tokens": g.tokens, "n_tokens": len(g.tokens),
            "deterministic": all(x.tokens == g.tokens for x in gm[1:] + ([prof] if prof else [])),
            **timings(gm), **g.acceptance(), **divergence(g.tokens, ref),
            "rounds_detail": round_table(prof or g)}
    if prof:
        item["first_token"] = first_token_ms(prof)
    if gb:
        item["base"] = timings(gb)
    return item


