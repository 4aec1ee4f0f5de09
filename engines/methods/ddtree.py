"""DDTree: a draft tree grown from one DFlash pass's per-position distributions, verified in one forward.

A DFlash drafter fills its K block positions in one pass, and each position's distribution does not
depend on the tokens drafted before it. So the top `top_k` tokens of every position span a tree of
continuations: a node at depth d is a token of position d, and a path's score is the sum of its
tokens' log-probabilities. The tree is grown best-first from the pending token (a heap of frontier
nodes; each node taken adds its position's next `top_k` tokens as children) until it holds
`total_tokens` nodes or every path reaches depth K; the target verifies it in one forward with tree
attention (engines/runtime/tree.py), the loop accepts the longest path its greedy choices match, and
the target cache keeps the root and that path. The drafter's context then grows by those positions'
hidden states, as DFlash A's does.

Hybrid (DeltaNet) targets cannot verify a tree, and a tree is verified greedily: on them, and at
temperature > 0, a round drafts DFlash A's chain. The drafter is DFlash's own (method.drafter as for
dflash_a); the tree's size is `total_tokens`, its width `top_k`, its depth the drafter's block.
"""

from __future__ import annotations

import heapq

import mlx.core as mx

from engines.base import Draft
from engines.methods.dflash import DFlashA


class DDTree(DFlashA):
    name = "ddtree"
    knobs = ("block_size", "drafter", "verify", "top_k", "total_tokens")
    adapts_drafts = False

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.top_k, self.total = cfg.top_k, cfg.total_tokens
        self.chain = target.layout.recurrent  # one recurrent state cannot hold many branches
        if not self.chain:
            self.block = self.total + 1  # tokens a full round verifies: the root and every node

    def draft(self, history):
        if self.chain or self.sampler.temperature > 0:
            return super().draft(history)
        logits = self.block_logits(history)  # [K, V]
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
        order = mx.argsort(-logprobs, axis=-1)[:, : self.top_k]  # [K, top_k] each position's best first
        best = mx.take_along_axis(logprobs, order, axis=-1)  # [K, top_k]
        self.prof.mark("drafter_topk", order, best)
        tokens, parents = grow_tree(order.tolist(), best.tolist(), self.total)  # the round's host read of the tree
        return Draft(mx.array(tokens, dtype=mx.int32), parents=parents)

    def verify(self, pending, draft):
        if draft.parents is None:
            return super().verify(pending, draft)
        logits, self.verified = self.target.verify_tree(mx.concatenate([pending, draft.tokens]), draft.parents)
        return logits  # [1 + nodes, V]

    def rollback(self, n_accepted, draft):
        if draft.parents is None:
            return super().rollback(n_accepted, draft)
        keep = [0, *(i + 1 for i in draft.accepted_path)]  # the root and the accepted path, in position order
        self.target.commit_tree(keep)
        self.context.append(self.verified[:, mx.array(keep)])  # [1, n+1, n*H] the kept positions' hidden states

    def describe(self):
        return {**super().describe(), "tree_path": "chain (hybrid target)" if self.chain else
                "tree (greedy); chain when sampling", "top_k": self.top_k, "total_tokens": self.total,
                "draft_block": self.draft_block}


def grow_tree(order: list[list[int]], logprobs: list[list[float]], budget: int) -> tuple[list[int], list[int]]:
    """The best-first tree over per-position candidates: order[d] the candidate tokens of depth d + 1 best
    first, logprobs[d] theirs. Returns (tokens, parents) of at most `budget` nodes, parents before children
    (-1 = the root), each node's score the sum of its path's log-probabilities, the highest taken first
    (ties: the earlier pushed)."""
    depth = len(order)
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(-logprobs[0][0], 0, -1, 0, 0.0)] if depth and order[0] else []  # (-score, seq, parent, d, up)
    seq = 1
    while frontier and len(tokens) < budget:
        neg, _, parent, j, up = heapq.heappop(frontier)
        d = tree_depth(parents, parent) if parent >= 0 else 0  # depth of the new node, 0-based position
        node = len(tokens)
        tokens.append(order[d][j])
        parents.append(parent)
        if j + 1 < len(order[d]):  # its next sibling: the same parent, the next candidate of the position
            heapq.heappush(frontier, (-(up + logprobs[d][j + 1]), seq, parent, j + 1, up))
            seq += 1
        if d + 1 < depth:  # its best child
            heapq.heappush(frontier, (-(-neg + logprobs[d + 1][0]), seq, node, 0, -neg))
            seq += 1
    return tokens, parents


def tree_depth(parents: list[int], node: int) -> int:
    """Depth below the root of `node`'s children, 0-based: the position its children draft."""
    d = 1
    while parents[node] >= 0:
        node, d = parents[node], d + 1
    return d
