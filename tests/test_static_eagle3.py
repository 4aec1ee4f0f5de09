"""EAGLE-3 under execution=static (engines/methods/eagle3.py Eagle3Static): the chain and the fixed-size tree
are greedy-lossless in float32 and draft what the eager engine drafts; a round never reads the host;
compiled phases trace once per shape; the drafter's static cache holds what the eager drafter's
holds; the device tree selection, acceptance and path compaction equal their host references.
tests/test_static.py runs the chain (depth 3, top_k 1) through every static method's test too."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engines.methods.eagle3 import Eagle3, _Node, select_tree
from engines.registry import get_engine
from engines.runtime.sampling import Sampler
from engines.runtime.static import StaticTarget, StaticTree, static_layout
from engines.runtime.target import Target
from engines.runtime.tree import accept_tree_greedy, accept_tree_on_device, depths_and_ancestors
from harness.generation import generate, run_generation
from harness.models.fixtures import drafter_dir
from tests.conftest import engine_cfg
from tests.helpers import same_cache_values

PROMPTS = [list(range(5, 25)), [7, 8, 9, 7, 8, 9, 7, 8, 9, 100, 7, 8], [3] * 40]  # the last passes gemma4's window
CHAIN, TREE = (3, 1, 3), (4, 4, 16)  # (depth, top_k, total_tokens)


def _cfg(arch, shape):
    depth, top_k, total = shape
    return engine_cfg(name="eagle3", drafter=str(drafter_dir("eagle3", arch)), depth=depth, top_k=top_k,
                      total_tokens=total)


def _static(model, arch, shape=TREE):
    return get_engine("eagle3", "static").build(model, _cfg(arch, shape))


def _run(engine, prompt, n=40, sampler=None, stop=frozenset()):
    return run_generation(engine, prompt, n, sampler or Sampler(0.0, 0), stop_tokens=stop)


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_the_static_tree_is_greedy_lossless_and_accepts_what_the_eager_tree_accepts(models, arch):
    model, _ = models[arch]
    static, eager = _static(model, arch), Eagle3.build(model, _cfg(arch, TREE))
    bases = [get_engine("base", "static").build(model, engine_cfg(name="base"))]
    if arch == "llama":  # (gemma4's eager base rounds its sliding layers otherwise: tests/test_static.py)
        bases.append(get_engine("base").build(model, engine_cfg(name="base")))
    for prompt in (PROMPTS[0], PROMPTS[2]):  # (tests/test_static.py runs the chain on all three)
        got, ref = _run(static, prompt, n=32), _run(eager, prompt, n=32)
        assert all(got.tokens == ref.tokens == _run(base, prompt, n=32).tokens for base in bases), prompt
        # the same tree (the same nodes, in another order) from the same drafter: the same accepted counts
        assert [r.accepted for r in got.rounds] == [r.accepted for r in ref.rounds], prompt
    assert static.describe()["tree_traces"] == 2 and static.target.traces == 0  # tree forward + path move


def test_the_static_chain_drafts_what_the_eager_chain_drafts(models):
    model, _ = models["llama"]
    static, eager = _static(model, "llama", CHAIN), Eagle3.build(model, _cfg("llama", CHAIN))
    for prompt in PROMPTS[:2]:
        got, ref = _run(static, prompt), _run(eager, prompt)
        assert got.tokens == ref.tokens and [r.accepted for r in got.rounds] == [r.accepted for r in ref.rounds]


def test_sampling_drafts_a_chain_that_equals_the_eager_chain_sample_for_sample(models):
    # Trees are greedy-only (as eager): at T > 0 the tree config drafts a chain of `depth`, verified by
    # speculative sampling with q, keyed by output positions held on the device.
    model, _ = models["llama"]
    static, eager = _static(model, "llama"), Eagle3.build(model, _cfg("llama", TREE))
    sampler = Sampler(1.0, 7)
    got, ref = _run(static, PROMPTS[0], sampler=sampler), _run(eager, PROMPTS[0], sampler=sampler)
    assert got.tokens == ref.tokens
    assert [r.accepted for r in got.rounds] == [r.accepted for r in ref.rounds]
    assert static.block == TREE[0] + 1 and static.target.traces == 1  # a chain's verify, no tree


def _round_under_compile(engine):
    """engine.round() traced by mx.compile with every array it carries (pending, output position, the
    commit pass's inputs, both caches) as traced inputs: any host read of them inside raises."""
    carried = [engine.target.state.arrays, engine.dstate.arrays]

    def traced(pending, out_pos, feats, fed, n):
        engine.pending, engine.out_pos, engine.feats, engine.fed, engine.n = pending, out_pos, feats, fed, n
        return engine.round()

    return mx.compile(traced, inputs=carried, outputs=carried)(engine.pending, engine.out_pos, engine.feats,
                                                                engine.fed, engine.n)


@pytest.mark.parametrize("shape,temperature", [(CHAIN, 0.0), (TREE, 0.0), (TREE, 1.0)])  # the last: a sampled chain
def test_a_round_never_reads_the_host(models, shape, temperature):
    model, _ = models["llama"]
    engine = _static(model, "llama", shape)
    engine.sampler = Sampler(temperature, 0)
    mx.eval(engine.start(PROMPTS[0], 20), engine.state())
    assert _round_under_compile(engine).shape == (1 + shape[0] + 1,)  # [n, depth + 1 tokens]
    cls = type(engine)

    def round_with_a_read(self):
        outcome = cls.round(self)
        outcome[0].item()
        return outcome

    engine.__class__ = type("Planted", (cls,), {"round": round_with_a_read})  # one .item(): the trace refuses it
    mx.eval(engine.start(PROMPTS[0], 20), engine.state())
    with pytest.raises(ValueError, match="eval an array during function transformations"):
        _round_under_compile(engine)


@pytest.mark.parametrize("shape", [CHAIN, TREE])
def test_every_compiled_phase_traces_once_per_shape_never_once_per_step(models, shape):
    model, _ = models["llama"]
    engine = _static(model, "llama", shape)
    counts = lambda: (engine.target.traces, engine.traces, engine.tree.traces)
    _run(engine, PROMPTS[0], n=8)
    first = counts()
    # the chain: its verify of K + 1 and its drafting phase; the tree: its drafting phase, tree forward, path move
    assert first == ((1, 1, 0) if shape == CHAIN else (0, 1, 2))
    _run(engine, PROMPTS[0], n=40)
    gen = _run(engine, PROMPTS[2], n=20)  # another prompt length, the same capacity bucket
    assert counts() == first
    acc = gen.acceptance()
    assert acc["host_reads"] == acc["rounds"] == acc["read_ahead"] > 0  # one read per round, each a round late


def _rounds(events, n):
    for _ in range(n):
        next(events)


@pytest.mark.parametrize("arch,shape", [("llama", CHAIN), ("llama", TREE), ("gemma4", TREE)])
def test_the_drafter_cache_holds_what_the_eager_drafters_holds_up_to_its_position(models, arch, shape):
    # After r drafting phases both drafters hold, below the pending position, one entry per committed
    # position (feature t, token t + 1); what lies past it (padding, tree entries) is masked.
    model, _ = models[arch]
    static, eager = _static(model, arch, shape), Eagle3.build(model, _cfg(arch, shape))
    sampler = Sampler(0.0, 0)
    r = 6
    s_events = generate(static, PROMPTS[1], 40, sampler)
    e_events = generate(eager, PROMPTS[1], 40, sampler)
    _rounds(s_events, r)  # the Prefill and r - 1 rounds read: r rounds queued (one ahead)
    _rounds(e_events, r + 1)  # the Prefill and r rounds: r drafts
    pos = static.dstate.position.item()
    assert pos == eager.dcache[0].offset > len(PROMPTS[1])
    for sc, ec in zip(static.dstate.caches, eager.dcache, strict=True):  # bit for bit on the CPU
        assert same_cache_values(sc.arrays["k"][..., :pos, :], ec.keys[..., :pos, :])
        assert same_cache_values(sc.arrays["v"][..., :pos, :], ec.values[..., :pos, :])


def test_the_late_read_never_emits_past_the_budget_or_a_stop_token_from_a_tree(models):
    model, _ = models["llama"]
    engine = _static(model, "llama")
    full = _run(engine, PROMPTS[0], n=30).tokens
    for n in (2, 11):
        assert _run(engine, PROMPTS[0], n=n).tokens == full[:n]
    stop = full[9]
    assert _run(engine, PROMPTS[0], n=30, stop=frozenset({stop})).tokens == full[: full.index(stop) + 1]


def _random_tree(rng, size):
    parents = []
    for i in range(size):
        parents.append(rng.randrange(-1, i))
    return parents


def test_device_tree_acceptance_walks_the_path_the_host_walks():
    rng = random.Random(0)
    for _ in range(300):
        parents = _random_tree(rng, rng.randint(1, 12))
        depth = max(depths_and_ancestors(parents)[0])
        tokens = [rng.randrange(4) for _ in parents]
        # distinct ids among siblings, as top_k children are
        for p in set(parents):
            kids = [i for i, q in enumerate(parents) if q == p]
            for j, i in enumerate(kids):
                tokens[i] = 10 * j + rng.randrange(2) * 100
        choices = [rng.choice(tokens + [7]) for _ in range(len(parents) + 1)]
        path, bonus = accept_tree_greedy(tokens, parents, choices)
        outcome, device_path = accept_tree_on_device(mx.array(tokens), mx.array([p + 1 for p in parents]),
                                                     mx.array(choices), depth)
        values = outcome.tolist()
        assert values[0] == len(path)
        assert values[1: len(path) + 2] == [*(tokens[i] for i in path), bonus]
        assert device_path.tolist()[: len(path) + 1] == [0, *(i + 1 for i in path)]


def test_device_tree_selection_keeps_the_nodes_the_host_selection_keeps():
    rng = random.Random(2)
    for _ in range(100):
        k, depth = rng.randint(1, 3), rng.randint(1, 4)
        # levels as Eagle3._tree makes them: k roots' children, then k * k children of k expanded nodes
        nodes, levels = [], [list(range(k))]
        for i in range(k):
            nodes.append(_Node(-1, -rng.choice([0.0, 0.5, 1.0, rng.random()]), 1))
        for d in range(2, depth + 1):
            frontier = sorted(rng.sample(levels[-1], min(k, len(levels[-1]))))
            level = []
            for p in frontier:
                for _ in range(k):
                    level.append(len(nodes))
                    nodes.append(_Node(p, nodes[p].score - rng.choice([0.0, 0.25, rng.random()]), d))
            levels.append(level)
        size = rng.randint(1, len(nodes))
        want = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[:size])
        assert Eagle3._close_under_ancestors(nodes, want) == want  # a child never outranks its parent
        tokens = mx.arange(len(nodes)) + 100
        got = select_tree(tokens, mx.array([n.score for n in nodes]), mx.array([n.parent for n in nodes]),
                          mx.array([n.depth for n in nodes]), size, depth)
        kept, parents, depths, ancestors = (x.tolist() for x in got)
        assert [t - 100 for t in kept] == want
        index = {node: i + 1 for i, node in enumerate(want)}
        assert parents == [index.get(nodes[i].parent, 0) for i in want]
        host_depths, host_ancestors = depths_and_ancestors([p - 1 for p in parents])
        assert depths == host_depths and ancestors == host_ancestors.tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_a_static_tree_verify_and_path_move_equal_the_eager_tree_verify_and_commit(models, arch):
    from tests.test_eagle3 import PARENTS

    model, _ = models[arch]
    static, eager = StaticTarget(model, static_layout(model)), Target(model)
    tree = StaticTree(static)
    rng = random.Random(1)
    prompt = [rng.randrange(1000) for _ in range(40)]  # past gemma's window of 32
    static.prefill(prompt, 200)
    eager.prefill(prompt)
    depth, ancestors = depths_and_ancestors(PARENTS)
    for path in ([0, 3, 5], [], [1], [0], [1, 4], [0, 2]):
        ids = [rng.randrange(1000) for _ in range(len(PARENTS) + 1)]
        start = static.position
        got = tree.forward(mx.array(ids), mx.array(depth), ancestors).logits
        want = eager.verify_tree(ids, PARENTS).logits
        assert mx.allclose(got, want, atol=1e-4)
        keep = [0, *(i + 1 for i in path)]
        tree.keep_path(start, mx.array(keep + [0] * (4 - len(keep))), mx.array(len(path)))
        eager.commit_tree(keep)
    pos = static.position.item()
    assert pos == eager.offset
    probe = [11, 12, 13]
    assert mx.allclose(static.verify(probe).logits, eager.verify(probe).logits, atol=1e-4)
