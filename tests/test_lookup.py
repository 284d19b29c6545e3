"""Prompt lookup (meshd/serving/lookup.py): what it drafts from a session's own tokens, and
how many tokens it drafts as its drafts are taken or not."""

from __future__ import annotations

from meshd.serving.lookup import MAX_DRAFT, PromptLookup


def test_lookup_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    look = PromptLookup()
    assert look.draft([1, 2, 3, 4], 8) == []  # nothing recurs
    tokens = [7, 1, 2, 3, 9, 1, 2, 5, 6, 1, 2]
    assert look.draft(tokens, 8) == [5, 6, 1, 2]  # (1, 2) last followed by 5 (the later match)
    assert look.draft(tokens + [3], 8) == [9, 1, 2, 5]  # (1, 2, 3): only the first occurrence
    assert look.draft(tokens + [3], 2) == [9, 1]  # no more than room allows
    look.taken(4, 4)
    assert look.k == 6 and look.draft(tokens + [3], 8) == [9, 1, 2, 5, 6, 1]  # all taken: more next time
    look.taken(6, 0)
    assert look.k == 3  # none taken: fewer
    for _ in range(10):
        look.taken(look.k, look.k)
    assert look.k == MAX_DRAFT
