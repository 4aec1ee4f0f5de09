"""Suffix decoding (engines/methods/suffix.py): the speculation tree keeps the most frequent
continuations of the longest recurring suffix, bounded by the match length; decoding is lossless in
float32 (a tree on attention targets, a chain on the hybrid); the workload holds other prompts'
outputs and never a prompt's own, so every rep of a prompt drafts alike."""

import pytest

from engines.methods.suffix import MIN_PROB, Suffix, best_path, speculation_tree
from engines.runtime.target import Target
from engines.runtime.tree import tree_depths
from tests.conftest import engine_cfg
from tests.helpers import base_tokens, generate_ids
from tests.test_lossless import NEW_TOKENS, _units


def _cfg(workload=True, **kw):
    return engine_cfg(name="suffix", **{"min_ngram": 1, "max_ngram": 32, "total_tokens": 16,
                                        "options": {"workload": workload}, **kw})


def test_the_tree_takes_the_most_frequent_continuations_first():
    conts = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 5], [6]] + [[1, 2, 3]] * 5
    tokens, parents = speculation_tree(conts, 4)
    # 9/10, 8/10, 7/10, then one of the 1/10 (= MIN_PROB) nodes: ties go to the one pushed first, the shallowest
    assert tokens == [1, 2, 3, 6] and parents == [-1, 0, 1, -1]
    assert best_path(tokens, parents) == [1, 2, 3]
    assert speculation_tree(conts, 2) == ([1, 2], [-1, 0])  # the budget cuts from the rare end
    rare = speculation_tree([[i] for i in range(20)], 16)  # each 1/20 < MIN_PROB: nothing is worth speculating
    assert MIN_PROB > 1 / 20 and rare == ([], [])
    tokens, parents = speculation_tree([[7, 8, 9, 10]] * 3, 16)
    assert tokens == [7, 8, 9, 10] and tree_depths(parents) == [1, 2, 3, 4]  # the continuation's length bounds it


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_suffix_decoding_is_lossless(models, arch):
    model, tok = models[arch]
    eng = Suffix(Target(model), _cfg())
    drafted = 0
    for _, ids in list(_units(tok))[::2]:
        want = base_tokens(model, ids, NEW_TOKENS)
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == want
        drafted += sum(r.drafted for r in got.rounds)
    assert drafted > 0  # it proposed something to verify
    assert eng.describe()["tree_path"] == ("chain (hybrid target)" if arch == "qwen35" else
                                           "tree (greedy); chain when sampling")


def test_every_rep_of_a_prompt_sees_the_same_workload_and_never_its_own_output(models):
    model, tok = models["llama"]
    units = [ids for _, ids in list(_units(tok))[:3]]
    eng = Suffix(Target(model), _cfg())
    first = generate_ids(eng, units[0], NEW_TOKENS)
    again = generate_ids(eng, units[0], NEW_TOKENS)  # its own output is in the workload now, and not used
    assert [r.drafted for r in again.rounds] == [r.drafted for r in first.rounds]
    generate_ids(eng, units[1], NEW_TOKENS)
    generate_ids(eng, units[2], NEW_TOKENS)
    assert eng.describe()["workload_outputs"] == 2  # units[0] and units[1]: the last one is recorded at the next
    alone = Suffix(Target(model), _cfg(workload=False))
    for ids in units:
        generate_ids(alone, ids, NEW_TOKENS)
    assert alone.describe()["workload_outputs"] == 0


def test_a_round_reads_only_the_occurrences_it_keeps_and_keeps_what_a_full_scan_would(models):
    import random

    from engines.methods.suffix import MAX_OCCURRENCES, SequenceIndex

    model, _ = models["llama"]
    eng = Suffix(Target(model), _cfg())
    rng = random.Random(0)
    eng.workload, eng.owner, eng.latest, eng.key = SequenceIndex(1, 3), [], {}, ("me",)
    for i in range(60):  # 60 earlier outputs of 5 prompts (one of them this prompt's own), 2,000 tokens each
        s = eng.workload.add([rng.randrange(4) for _ in range(2000)])
        eng.workload.extend(s, 1999)
        owner = ("me",) if i % 5 == 0 else (i % 5,)
        eng.owner.append(owner)
        eng.latest[owner] = s
    eng.request = SequenceIndex(1, 3)
    eng.request.add([rng.randrange(4) for _ in range(50)])
    eng.request.extend(0, 49)
    checked = []
    usable = eng._usable
    eng._usable = lambda s: checked.append(s) or usable(s)
    for gram in [(1,), (2, 3), (0, 1, 2)]:
        checked.clear()
        full = [(eng.workload, o) for o in eng.workload.occurrences(gram) if usable(o[0])]
        full = (full + [(eng.request, o) for o in eng.request.occurrences(gram)])[-MAX_OCCURRENCES:]
        assert eng._latest(gram) == full  # the same occurrences in the same order as scanning them all
        assert len(checked) <= 2 * MAX_OCCURRENCES  # ~30,000 occurrences of a 1-gram: a few dozen looked at
