"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): a speculation tree from what followed the
history's longest recurring suffix, in this request and in the cell's earlier outputs. No model.

Two indexes of the n-grams (min_ngram <= n <= max_ngram) of token sequences, each n-gram mapped
to the positions where it ends: one over this request's prompt and output (grown as it decodes),
and one over the workload, the outputs of the cell's earlier generations of other prompts
(`method.options.workload`). Each round takes the longest suffix of the history that occurred before,
gathers the continuations of its latest MAX_OCCURRENCES occurrences into a trie, scores each
node by the share of occurrences that reach it, and keeps the best nodes (each at least
MIN_PROB) up to min(total_tokens, SPEC_FACTOR x the match length): a long match earns a large
tree, a short one a small tree. The target verifies the tree in one forward (engines/runtime/
tree.py); hybrid targets and temperature > 0 verify its most frequent path as a chain, whose
drafts are deterministic, so the loop's deterministic-draft rule keeps the target's distribution.

The workload holds one output per prompt (keyed by the prompt's last KEY_TOKENS ids), the latest,
and a generation never sees its own prompt's: every rep of a prompt matches against the same
earlier outputs, in the cell's prompt order. An output is recorded when the next generation
starts, as far as the drafts saw it (the last round's tokens are not in it).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

import mlx.core as mx

from engines.base import Draft, Engine

MAX_OCCURRENCES = 32  # latest occurrences of the matched suffix whose continuations form the trie
SPEC_FACTOR = 1.0  # tree nodes allowed per matched token (SuffixDecoding's max_spec_factor)
MIN_PROB = 0.1  # a node reached by a smaller share of the occurrences is not speculated
KEY_TOKENS = 64  # a prompt's identity in the workload: its last ids (a context-scaling copy keeps them)


class SequenceIndex:
    """End positions of every n-gram (min_n..max_n) of a set of sequences, grown incrementally."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple, list[tuple[int, int]]] = defaultdict(list)  # n-gram -> [(sequence, end)]
        self.seqs: list[list[int]] = []
        self.indexed: list[int] = []

    def add(self, seq: list[int]) -> int:
        self.seqs.append(seq)
        self.indexed.append(0)
        return len(self.seqs) - 1

    def extend(self, s: int, upto: int) -> None:
        """Index sequence s's n-grams ending before `upto` (those with a token after them)."""
        seq = self.seqs[s]
        for end in range(self.indexed[s], upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.ends[tuple(seq[end - n + 1: end + 1])].append((s, end))
        self.indexed[s] = max(self.indexed[s], upto)

    def occurrences(self, gram: tuple) -> list[tuple[int, int]]:
        return self.ends.get(gram, [])


def speculation_tree(continuations: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """The trie of `continuations` cut to its `budget` most frequent nodes (each reached by at least
    MIN_PROB of them): (tokens, parents), parents before children, -1 = the root. A child is never more
    frequent than its parent, so taking nodes by count keeps the tree prefix-closed."""
    total = len(continuations)
    tokens: list[int] = []
    parents: list[int] = []
    frontier = []  # (-count, seq, parent, depth, token, members)
    seq = 0

    def push(parent: int, depth: int, members: list[int]) -> None:
        nonlocal seq
        groups: dict[int, list[int]] = defaultdict(list)
        for c in members:
            if depth < len(continuations[c]):
                groups[continuations[c][depth]].append(c)
        for tok, group in groups.items():
            heapq.heappush(frontier, (-len(group), seq, parent, depth, tok, group))
            seq += 1

    push(-1, 0, list(range(total)))
    while frontier and len(tokens) < budget:
        neg, _, parent, depth, tok, group = heapq.heappop(frontier)
        if -neg < MIN_PROB * total:
            break  # every node left is rarer still
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        push(node, depth + 1, group)
    return tokens, parents


def best_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The chain of first-taken children from the root: the tree's most frequent path."""
    out, at = [], -1
    for i, p in enumerate(parents):
        if p == at:
            out.append(tokens[i])
            at = i
    return out


class Suffix(Engine):
    name = "suffix"
    knobs = ("min_ngram", "max_ngram", "total_tokens", "verify")
    options = {"workload": True}  # match the cell's earlier outputs of other prompts too, not only this request

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.min_n, self.max_n, self.total = cfg.min_ngram, cfg.max_ngram, cfg.total_tokens
        self.use_workload = self.opt["workload"]
        self.tree = not target.layout.recurrent  # one recurrent state cannot hold many branches
        self.block = self.total + 1  # tokens a full round verifies: the root and every node
        self.workload = SequenceIndex(self.min_n, self.max_n)  # every recorded output, kept across generations
        self.owner: list[tuple] = []  # workload sequence -> the prompt key it answered
        self.latest: dict[tuple, int] = {}  # prompt key -> its latest output's sequence
        self.history: list[int] | None = None

    def prefill(self, prompt):
        self._record_output()
        self.prompt_len, self.key = len(prompt), tuple(prompt[-KEY_TOKENS:])
        self.request = SequenceIndex(self.min_n, self.max_n)
        self.request.add([])
        return super().prefill(prompt)

    def _record_output(self) -> None:
        # the previous generation's output, as far as its drafts saw it, becomes part of the workload
        if self.history is not None and self.use_workload:
            out = self.history[self.prompt_len:]
            s = self.workload.add(out)
            self.workload.extend(s, len(out) - 1)
            self.owner.append(self.key)
            self.latest[self.key] = s
        self.history = None

    def draft(self, history):
        self.history = history
        seq = self.request.seqs[0]
        seq.extend(history[len(seq):])
        self.request.extend(0, len(seq) - 1)
        tokens, parents = self._propose(history)
        if not tokens:
            return Draft()
        if not self.tree or self.sampler.temperature > 0:
            return Draft(mx.array(best_path(tokens, parents), dtype=mx.int32))
        return Draft(mx.array(tokens, dtype=mx.int32), parents=parents)

    def _usable(self, s: int) -> bool:
        # another prompt's latest output: never this prompt's own, never one since replaced
        return self.owner[s] != self.key and self.latest[self.owner[s]] == s

    def _propose(self, history) -> tuple[list[int], list[int]]:
        """The speculation tree after the longest suffix of `history` that occurred before (request and
        workload), or nothing where no suffix of min_ngram tokens did."""
        for n in range(min(self.max_n, len(history)), self.min_n - 1, -1):
            found = self._latest(tuple(history[-n:]))
            if found:
                budget = min(self.total, max(1, int(SPEC_FACTOR * n)))
                conts = [index.seqs[s][end + 1: end + 1 + budget] for index, (s, end) in found]
                return speculation_tree(conts, budget)
        return [], []

    def _latest(self, gram: tuple) -> list:
        """The latest MAX_OCCURRENCES occurrences of `gram`: the request's, then usable workload ones before
        them, oldest first. Walked from the newest and stopped when enough are found, so a round costs what
        it keeps, not the history's length (a one-token n-gram recurs once per few tokens of output)."""
        request = self.request.occurrences(gram)[-MAX_OCCURRENCES:]
        room = MAX_OCCURRENCES - len(request)
        usable = (o for o in reversed(self.workload.occurrences(gram)) if self._usable(o[0]))
        workload = list(itertools.islice(usable, room))[::-1] if room else []
        return [(self.workload, o) for o in workload] + [(self.request, o) for o in request]

    def verify(self, pending, draft):
        if draft.parents is None:
            return super().verify(pending, draft)
        return self.target.verify_tree(mx.concatenate([pending, draft.tokens]), draft.parents).logits

    def rollback(self, n_accepted, draft):
        if draft.parents is None:
            return super().rollback(n_accepted, draft)
        self.target.commit_tree([0, *(i + 1 for i in draft.accepted_path)])

    def describe(self):
        return {**super().describe(), "tree_path": "tree (greedy); chain when sampling" if self.tree else
                "chain (hybrid target)", "total_tokens": self.total, "min_ngram": self.min_n, "max_ngram": self.max_n,
                "workload": self.use_workload, "workload_outputs": len(self.latest),
                "spec_factor": SPEC_FACTOR, "min_prob": MIN_PROB}
