"""n-gram drafting proposes the continuation of the latest earlier match, and nothing without one."""
from engine.spec.ngram import ngram_draft


def test_proposes_what_followed_the_latest_match():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert ngram_draft(history, n=3, n_max=2) == [7, 8]


def test_stops_at_the_end_of_the_history():
    assert ngram_draft([4, 5, 6, 4, 5], n=2, n_max=5) == [6, 4, 5]


def test_no_match_no_draft():
    assert ngram_draft([1, 2, 3, 4, 5], n=2, n_max=3) == []
    assert ngram_draft([1, 2], n=3, n_max=3) == []
