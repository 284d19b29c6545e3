"""Prompt lookup: drafts for speculative decoding taken from a session's own tokens.

An answer that repeats its prompt (rewrite this JSON, list these functions, quote this
passage) repeats n-grams of it: after the last ``n`` tokens, the tokens that followed
their most recent earlier occurrence are a good guess of what comes next. No model runs
to make the guess; the pipeline checks the guess in the step it runs anyway (one row per
drafted token beside the session's own), and the scheduler keeps what the model itself
picks (``Pipeline`` and ``Scheduler`` hold the rule). The same idea as llama.cpp's
``lookup`` example and transformers' ``prompt_lookup_num_tokens``.
"""

from __future__ import annotations

MAX_NGRAM = 4  # the longest suffix matched first: a longer match is a surer guess
MIN_NGRAM = 2  # a single token recurs too often in free text to guess from
MAX_DRAFT = 8  # tokens drafted per step at most
START_DRAFT = 4


class PromptLookup:
    """The n-grams of one session's tokens, each mapped to the position of the token that
    followed its latest occurrence; kept up to date as the session's tokens grow."""

    def __init__(self) -> None:
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # followers at positions below this are in ``_after``
        self.k = START_DRAFT  # drafts asked for next: grows while they are taken, shrinks when not

    def draft(self, tokens: list[int], most: int) -> list[int]:
        """Up to ``min(most, k)`` tokens that followed the latest earlier occurrence of the
        longest suffix of ``tokens`` (MAX_NGRAM down to MIN_NGRAM tokens) seen before; []
        when no suffix recurs."""
        self._index(tokens)
        want = min(most, self.k)
        if want <= 0:
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            at = self._after.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + want]
        return []

    def taken(self, drafted: int, accepted: int) -> None:
        """How a draft went: ``k`` follows the acceptance (all taken: more next time; none: fewer)."""
        if drafted and accepted == drafted:
            self.k = min(MAX_DRAFT, self.k + 2)
        elif drafted and accepted == 0:
            self.k = max(1, self.k // 2)

    def _index(self, tokens: list[int]) -> None:
        """Record each n-gram that ends before a known follower: the one ending at ``p``
        (exclusive) is followed by ``tokens[p]``; the suffix itself has no follower yet."""
        if self._indexed > len(tokens):  # the session's tokens were cut back: index again
            self._after.clear()
            self._indexed = 0
        for p in range(max(self._indexed, MIN_NGRAM), len(tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, p) + 1):
                self._after[tuple(tokens[p - n:p])] = p
        self._indexed = max(self._indexed, len(tokens))
