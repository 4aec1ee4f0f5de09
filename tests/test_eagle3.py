"""EAGLE-3: tree masks, tree verify + compaction, losslessness, checkpoint layouts."""

import json
import random
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engines.drafters.eagle3 import load_eagle3
from engines.errors import DrafterError
from engines.methods.eagle3 import Eagle3
from engines.runtime.target import Target
from engines.runtime.tree import _tree_mask_fn, accept_tree_greedy, depths_and_ancestors
from harness.models import fixtures
from tests.conftest import ARCHS, engine_cfg
from tests.helpers import base_tokens, generate_ids
from tests.test_lossless import NEW_TOKENS, _units
from tests.test_rollback import TOL, _max_diff

#        root
#       /    \
#      0      1
#     / \      \
#    2   3      4
#        |
#        5
PARENTS = [-1, -1, 0, 0, 1, 3]


def eagle_cfg(arch, depth=4, top_k=4, total_tokens=16):
    return engine_cfg(drafter=str(fixtures.drafter_dir("eagle3", arch)), verify="batched", depth=depth,
                           top_k=top_k, total_tokens=total_tokens)


def test_each_node_sees_exactly_its_ancestors_and_itself():
    depth, anc = depths_and_ancestors(PARENTS)
    assert depth == [0, 1, 1, 2, 2, 2, 3]
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 4, 6}}
    for i, row in enumerate(anc.tolist()):
        assert {j for j, v in enumerate(row) if v} == want[i]


def test_tree_mask_adds_the_committed_prefix_and_the_sliding_window():
    depth, anc = depths_and_ancestors(PARENTS)
    fn = _tree_mask_fn(mx.array(depth), anc)
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    mask = fn(mx.zeros((1, 7, 8)), kv)
    assert mask.shape == (7, 17)
    assert mask[:, :10].all().item()  # the whole committed prefix
    assert mx.array_equal(mask[:, 10:], anc).item()
    rot = RotatingKVCache(max_size=4)
    rot.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    mask = fn(mx.zeros((1, 7, 8)), rot, window_size=4)
    assert mask.shape == (7, 3 + 7)  # a window of 4 keeps the last 3 committed positions
    # root at position 10 sees 7, 8, 9; a depth-3 node (position 13) sees none of them
    assert mask[0, :3].tolist() == [True, True, True] and mask[6, :3].tolist() == [False, False, False]
    assert mask[1, :3].tolist() == [False, True, True]  # depth 1, position 11: sees 8 and 9
    assert mask[3, :3].tolist() == [False, False, True]  # depth 2, position 12: sees 9 only


def test_greedy_tree_acceptance_walks_the_matching_path():
    tokens = [10, 11, 20, 21, 30, 40]
    # choices per tree index (0 = root): root -> 10 (node 0), node 0 -> 21 (node 3), node 3 -> 40 (node 5)
    choices = [10, 21, 99, 98, 40, 97, 7]  # ... and at node 5 (tree index 6) the target says 7: the bonus
    assert accept_tree_greedy(tokens, PARENTS, choices) == ([0, 3, 5], 7)
    assert accept_tree_greedy(tokens, PARENTS, [12, 0, 0, 0, 0, 0, 0]) == ([], 12)


@pytest.mark.parametrize("arch", ["llama", "gemma4", "gemma4_moe"])
def test_compacted_cache_equals_a_fresh_run_over_the_accepted_path(models, arch):
    model, _ = models[arch]
    rng = random.Random(1)
    prompt = [rng.randrange(1000) for _ in range(40)]  # past gemma's window of 32
    t, fresh = Target(model), Target(model)
    t.prefill(prompt)
    fresh.prefill(prompt)
    # every root-to-node path of PARENTS: the first two keep entries already in place (a trim), the rest move
    for path in ([0, 3, 5], [], [1], [0], [1, 4], [0, 2]):
        root, nodes = rng.randrange(1000), [rng.randrange(1000) for _ in PARENTS]
        t.verify_tree([root, *nodes], PARENTS)
        keep = [0, *(i + 1 for i in path)]
        t.commit_tree(keep)
        fresh.forward([root, *(nodes[i] for i in path)])
    assert _max_diff(t, fresh) <= TOL
    assert mx.abs(t.verify([7, 8]).logits - fresh.forward([7, 8]).logits).max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_greedy_output_is_identical_to_base(models, arch):
    model, tok = models[arch]
    eng = Eagle3.build(model, eagle_cfg(arch))
    tokens = rounds = trees = 0
    for _, ids in list(_units(tok))[::3]:
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == base_tokens(model, ids, NEW_TOKENS)
        tokens, rounds = tokens + got.decode_tokens, rounds + len(got.rounds)
        trees += sum(r.tree_size > 0 for r in got.rounds)
    assert (trees > 0) == (arch != "qwen35"), "trees on attention targets, chains on the hybrid"
    assert tokens / rounds > 1.3, f"tau {tokens / rounds:.2f}"


def test_trees_are_laid_out_best_child_first_so_the_likely_path_needs_no_cache_moves(models, monkeypatch):
    from engines.methods.eagle3 import _Node

    #  root -> a (0.9) -> c (0.5), d (0.7); root -> b (0.8) -> e (0.6)
    nodes = [_Node(-1, 0.8, 1), _Node(-1, 0.9, 1), _Node(1, 0.5, 2), _Node(1, 0.7, 2), _Node(0, 0.6, 2)]
    assert Eagle3._best_first(nodes, [0, 1, 2, 3, 4]) == [1, 3, 2, 0, 4]  # depth first, best sibling first
    model, tok = models["llama"]
    keeps = []
    real = Target.commit_tree
    monkeypatch.setattr(Target, "commit_tree", lambda self, keep: keeps.append(list(keep)) or real(self, keep))
    eng = Eagle3.build(model, eagle_cfg("llama"))
    for _, ids in list(_units(tok))[:6]:
        assert generate_ids(eng, ids, 32).tokens == base_tokens(model, ids, 32)
    deep = [k for k in keeps if len(k) >= 3]  # two or more drafts accepted
    # a breadth-first layout keeps such a path in place only when a level has one node (1 of 16 here)
    assert sum(k == list(range(len(k))) for k in deep) >= len(deep) / 3, deep


def test_sampling_drafts_a_chain_and_keeps_running(models):
    model, tok = models["llama"]
    ids = next(_units(tok))[1]
    got = generate_ids(Eagle3.build(model, eagle_cfg("llama")), ids, 24, temperature=1.0, seed=3)
    assert len(got.tokens) == 24 and all(r.tree_size == 0 for r in got.rounds)


def _eagle_layout(tmp_path):
    """The llama fixture drafter rewritten in SafeAILab's EAGLE-3 layout."""
    src = fixtures.drafter_dir("eagle3", "llama")
    cfg = json.loads((src / "config.json").read_text())
    flat = {**cfg["transformer_layer_config"], "draft_vocab_size": cfg["draft_vocab_size"],
            "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]}
    dst = tmp_path / "safeailab"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(flat))
    w = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(str(dst / "model.safetensors"),
                        {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                         for k, v in w.items()})
    return dst


def test_speculators_and_safeailab_layouts_load_the_same_drafter(models, tmp_path):
    model, _ = models["llama"]
    a = load_eagle3(fixtures.drafter_dir("eagle3", "llama"), model)
    b = load_eagle3(_eagle_layout(tmp_path), model)
    assert a.config.layout == "speculators" and b.config.layout == "eagle"
    from mlx.utils import tree_flatten
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert pa.keys() == pb.keys() and all(mx.array_equal(pa[k], pb[k]).item() for k in pa)


@pytest.mark.parametrize("edit, message", [
    (lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), "must be distinct layer ids in 1..4"),
    (lambda c, w: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), "fc.weight takes 384 inputs"),
    (lambda c, w: w.update({"layers.1.mlp.up_proj.weight": w["fc.weight"]}), "tensor(s) layers.1.mlp.up_proj.weight not implemented"),
    (lambda c, w: c.update(shiny_new_feature=True), "config field(s) shiny_new_feature not implemented"),
    (lambda c, w: c.update(target_hidden_size=64), "target_hidden_size 64 != target hidden size 128"),
    (lambda c, w: w.pop("fc.weight"), "fc.weight is missing"),
    (lambda c, w: w.update(d2t=w["d2t"] + 5000), "d2t maps draft ids outside the target vocab"),
])
def test_bad_eagle3_drafters_give_one_line_errors(models, tmp_path, edit, message):
    src = fixtures.drafter_dir("eagle3", "llama")
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg, w = json.loads((dst / "config.json").read_text()), mx.load(str(dst / "model.safetensors"))
    edit(cfg, w)
    (dst / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    with pytest.raises(DrafterError) as e:
        load_eagle3(dst, models["llama"][0])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_default_aux_layers_follow_the_reference():
    from engines.drafters.eagle3 import default_aux_layers
    assert default_aux_layers(32) == (2, 16, 29)


def test_a_quantized_drafter_drafts_a_tree_losslessly(models):
    """The shipped drafters are 4-bit and stay quantized on GPU backends: the tree's root is one
    hidden state, which MLX's CUDA quantized matmul refused as a 1-D input (run on the device
    with `pytest -m cuda`)."""
    import mlx.nn as nn

    model, tok = models["llama"]
    eng = Eagle3.build(model, eagle_cfg("llama"))
    nn.quantize(eng.drafter, group_size=32, bits=8,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    assert "scales" in eng.drafter.lm_head, "the drafter's head is quantized"
    h = mx.random.normal((eng.drafter.norm.weight.shape[0],))
    assert mx.array_equal(eng.drafter.logits(h, model), eng.drafter.logits(h[None], model)[0])
    ids = next(_units(tok))[1]
    got = generate_ids(eng, ids, NEW_TOKENS)
    assert got.tokens == base_tokens(model, ids, NEW_TOKENS)
    assert any(r.tree_size > 0 for r in got.rounds)


def test_the_tree_is_selected_on_the_device_and_read_once_a_round(models, monkeypatch):
    # EAGLE-2's policy: each level expands its top_k nodes by cumulative score, and the draft keeps
    # the total_tokens best; the host reads nothing until one mx.eval after the last level
    model, tok = models["llama"]
    eng = Eagle3.build(model, eagle_cfg("llama", depth=4, top_k=3, total_tokens=10))
    seen, rounds, inside = [], [], [False]
    real_select, real_tree, real_eval, real_tolist = eng._select, eng._tree, mx.eval, mx.array.tolist

    def tree(*a):
        rounds.append([])  # what the host did, in order: "eval", or "read" (a host read before any eval)
        inside[0] = True
        try:
            return real_tree(*a)
        finally:
            inside[0] = False

    def note(what, fn):
        def wrapped(*a):
            if inside[0] and (what == "eval" or "eval" not in rounds[-1]):
                rounds[-1].append(what)
            return fn(*a)
        return wrapped
    monkeypatch.setattr(eng, "_select", lambda nodes: seen.append(nodes) or real_select(nodes))
    monkeypatch.setattr(eng, "_tree", tree)
    monkeypatch.setattr(mx, "eval", note("eval", real_eval))
    monkeypatch.setattr(mx.array, "tolist", note("read", real_tolist))
    ids = next(_units(tok))[1]
    got = generate_ids(eng, ids, 24)
    assert got.tokens == base_tokens(model, ids, 24) and seen
    assert rounds and all(r == ["eval"] for r in rounds), rounds[:3]
    for nodes in seen:
        assert [n.depth for n in nodes] == [1] * 3 + [2] * 9 + [3] * 9 + [4] * 9
        for d in (1, 2, 3):  # the nodes with children are the level's 3 best
            level = [i for i, n in enumerate(nodes) if n.depth == d]
            best = sorted(level, key=lambda i: (-nodes[i].score, i))[:3]
            assert sorted({n.parent for n in nodes if n.depth == d + 1}) == sorted(best)
        for n in nodes:
            if n.parent >= 0:  # a child's score adds its log-probability to its parent's
                assert n.score <= nodes[n.parent].score + 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_draft_threshold_drafts_a_chain_cut_before_its_first_unsure_draft_and_stays_lossless(models, arch):
    model, tok = models[arch]
    c = eagle_cfg(arch, depth=5)
    c.draft_threshold = 0.5
    eng = Eagle3.build(model, c)
    drafted = []
    for _, ids in list(_units(tok))[::4]:
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == base_tokens(model, ids, NEW_TOKENS)
        assert not any(r.tree_size for r in got.rounds)  # a chain, also on an attention target
        drafted += [r.drafted for r in got.rounds]
    assert max(drafted) <= 5 and len(set(drafted)) >= 2, drafted  # a varying K, never above the depth
    assert eng.block == 6 and eng.describe()["tree_path"] == ("chain (hybrid target)" if arch == "qwen35"
                                                              else "chain (draft_threshold)")
