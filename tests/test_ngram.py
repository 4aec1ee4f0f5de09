from engines.methods.ngram import NgramIndex


def propose(history, k=3, lo=1, hi=3):
    return NgramIndex(lo, hi).propose(history, k)


def test_longest_suffix_ngram_wins_over_shorter_ones():
    # suffix (1, 2): the 1-gram "2" last occurred followed by 9, the 2-gram "1 2" by 5
    assert propose([1, 2, 5, 6, 7, 2, 9, 1, 2]) == [5, 6, 7]


def test_most_recent_earlier_occurrence_is_used():
    assert propose([4, 10, 11, 4, 20, 21, 4], k=2) == [20, 21]


def test_no_match_gives_an_empty_draft():
    assert propose([1, 2, 3, 4]) == []


def test_min_ngram_excludes_shorter_matches():
    assert propose([7, 8, 9, 1, 7], lo=2) == []
    assert propose([7, 8, 9, 1, 7], lo=1) == [8, 9, 1]


def test_draft_is_cut_at_k_and_a_match_near_the_end_repeats_its_period():
    assert propose([3, 1, 2, 3], k=1) == [1]
    assert propose([5, 6, 5], k=3) == [6, 5, 6]  # period 2 from the latest 5
    assert propose([9, 7, 7, 7], k=4) == [7, 7, 7, 7]  # a one-token loop fills all of K
    assert propose([1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]  # period 3 from the latest (1, 2)


def test_incremental_index_equals_a_fresh_index():
    history = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    idx = NgramIndex(1, 3)
    for end in range(2, len(history) + 1):
        assert idx.propose(history[:end], 3) == NgramIndex(1, 3).propose(history[:end], 3)
