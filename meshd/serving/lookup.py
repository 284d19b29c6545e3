"""Prompt lookup: drafts for speculative decoding taken from a session's own tokens, and
how many of them a step should carry.

An answer that repeats its prompt (rewrite this JSON, list these functions, quote this
passage) repeats n-grams of it: after the last ``n`` tokens, the tokens that followed
their most recent earlier occurrence are a good guess of what comes next. No model runs
to make the guess; the pipeline checks the guess in the step it runs anyway (one row per
drafted token beside the session's own), and the scheduler keeps what the model itself
picks (``Pipeline`` and ``Scheduler`` hold the rule). The same idea as llama.cpp's
``lookup`` example and transformers' ``prompt_lookup_num_tokens``.

Whether a draft pays depends on the hardware: on a GPU a step's extra rows cost almost
nothing, on a CPU each costs a good part of a row (SmolLM2 Q4_1, the whole model on one
core, layers and head: 1 row 12.2 ms, 2 rows 17.8, 3 rows 21.1, 5 rows 27.7, 9 rows 46.8;
the block kernel decodes a weight block once for up to 8 rows and joins the input's two
roundings in one int16 dot, but each row's own dot products are still most of a row's
cost). ``StepCost`` learns that curve from the steps
the scheduler runs, ``MatchRates`` how often drafts are taken by the length of the suffix
they matched, and ``best_draft`` picks the draft length that makes the most tokens per
second: none where drafts do not pay (free text on a CPU), several where they do.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_NGRAM = 4  # the longest suffix matched first: a longer match is a surer guess
MIN_NGRAM = 2  # a single token recurs too often in free text to guess from
MAX_DRAFT = 8  # tokens drafted per step at most
DECAY = 0.8  # of the acceptance counts at each draft (recent drafts weigh most)
EMA = 0.2  # weight of a new step time in ``StepCost``
# Plain steps in a row after which ``best_draft`` drafts one row where the prior cost says
# it would pay, to measure a row again: a row cost learned while the box was busy would
# otherwise stop drafting for good (nothing drafted, nothing re-measured). A probe's time
# moves the cost as any drafted step's does: one lucky probe does not turn drafts on.
PROBE_AFTER = 64


class Acceptance:
    """How often a proposer's drafted tokens were taken: decayed counts from a prior."""

    def __init__(self, taken: float = 1.0, missed: float = 1.0) -> None:
        self.taken_n, self.missed_n = taken, missed

    @property
    def rate(self) -> float:
        """The chance that a drafted token is taken, as seen so far."""
        return self.taken_n / (self.taken_n + self.missed_n)

    def taken(self, drafted: int, accepted: int) -> None:
        """How a draft went: ``accepted`` of its ``drafted`` tokens taken (then one missed,
        unless all were taken)."""
        self.taken_n = self.taken_n * DECAY + accepted
        self.missed_n = self.missed_n * DECAY + (accepted < drafted)


class MatchRates:
    """How often this peer's lookup drafts were taken, by the length of the suffix they
    matched (MIN_NGRAM .. MAX_NGRAM): what a draft is worth is the match's more than the
    session's. A session that copies a document matches 4 tokens nearly every step, and
    such drafts are taken nearly whole, while free text matches 2 and is mostly missed. A
    rate of the session's own ramped up from one drafted token after each miss (drafts of
    1, 1, 1, 2, 2, 3, 4, 6, 8 before the first full one: measured on the bench's module
    prompt), where the 4-token matches' rate, learned over every session, drafts 8 from
    the first step; free text's short matches keep their own, low, rate."""

    def __init__(self) -> None:
        self._by_length = {n: Acceptance() for n in range(MIN_NGRAM, MAX_NGRAM + 1)}

    def rate(self, matched: int) -> float:
        """The chance that a token of a draft matching ``matched`` tokens is taken."""
        return self._by_length[matched].rate

    def taken(self, matched: int, drafted: int, accepted: int) -> None:
        self._by_length[matched].taken(drafted, accepted)

    def held_back(self, matched: int, guess: int, token: int) -> None:
        """A draft's first token that was not sent (it did not pay) against the token the
        step gave: a draft's worth is still learned while none is sent."""
        self._by_length[matched].taken(1, int(guess == token))


class PromptLookup:
    """The n-grams of one session's tokens, each mapped to the position of the token that
    followed its latest occurrence, kept up to date as the session's tokens grow; and the
    length of the suffix its last draft (or peek) matched, which says what the draft is
    worth (``MatchRates``)."""

    def __init__(self) -> None:
        self._after: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # followers at positions below this are in ``_after``
        self.guess: int | None = None  # the first token of a draft not sent (its outcome is still news)
        self.matched = MIN_NGRAM  # the suffix length the last draft or peek matched
        self.sent = MIN_NGRAM  # ``matched`` of the draft checked (or held back) in the step under way

    def draft(self, tokens: list[int], most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` (MAX_NGRAM down to MIN_NGRAM tokens) seen before; [] when no
        suffix recurs."""
        self._index(tokens)
        return self._follow(tokens, most, {})

    def peek(self, tokens: list[int], most: int) -> list[int]:
        """What ``draft(tokens, most)`` would give, with nothing indexed for good: ``tokens``
        extend the ones indexed so far (a guess of the session's next tokens), and the
        n-grams past those go into a map thrown away after ([] where ``tokens`` are shorter)."""
        if self._indexed > len(tokens):
            return []
        newer: dict[tuple[int, ...], int] = {}
        for key, p in _ngrams(tokens, self._indexed):
            newer[key] = p
        return self._follow(tokens, most, newer)

    def _follow(self, tokens: list[int], most: int, newer: dict[tuple[int, ...], int]) -> list[int]:
        if most <= 0:
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(tokens) <= n:
                continue
            key = tuple(tokens[-n:])
            at = newer.get(key, self._after.get(key))  # (``newer``'s are the later occurrences)
            if at is not None:
                self.matched = n
                return tokens[at:at + most]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Record each n-gram that ends before a known follower: the one ending at ``p``
        (exclusive) is followed by ``tokens[p]``; the suffix itself has no follower yet."""
        if self._indexed > len(tokens):  # the session's tokens were cut back: index again
            self._after.clear()
            self._indexed = 0
        for key, p in _ngrams(tokens, self._indexed):
            self._after[key] = p
        self._indexed = max(self._indexed, len(tokens))


def _ngrams(tokens: list[int], since: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, the position of the token after it) for each follower at ``since`` or later,
    in order (a later occurrence of an n-gram after an earlier one)."""
    for p in range(max(since, MIN_NGRAM), len(tokens)):
        for n in range(MIN_NGRAM, min(MAX_NGRAM, p) + 1):
            yield tuple(tokens[p - n:p]), p


class StepCost:
    """What a step of one session costs, learned from the steps run: ``plain`` seconds
    for its one row, ``row`` more for each drafted row beside it."""

    def __init__(self) -> None:
        self.plain: float | None = None
        self.row: float | None = None
        self.undrafted = 0  # plain steps since the last drafted one

    def ran(self, seconds: float, drafted: int) -> None:
        """A step of one session with ``drafted`` draft rows took ``seconds``."""
        if drafted == 0:
            self.plain = seconds if self.plain is None else (1 - EMA) * self.plain + EMA * seconds
            self.undrafted += 1
        elif self.plain is not None:
            extra = max(0.0, (seconds - self.plain) / drafted)
            self.row = extra if self.row is None else (1 - EMA) * self.row + EMA * extra
            self.undrafted = 0

    def best_draft(self, rate: float, most: int, guess: float = 0.0) -> int:
        """The draft length (0..most) that makes the most tokens per second at ``rate``:
        k drafts give 1 + rate + ... + rate^k tokens for plain + k * (row + guess) seconds
        (``guess``: what making one drafted token costs, a draft model's forward; lookup's
        is free). Before a plain step was timed, none; before a drafted one, a row is taken
        to cost a quarter of a plain step (it is learned at the first drafted step). After
        ``PROBE_AFTER`` plain steps in a row, one where a row at that prior cost would pay,
        so that a cost learned while the box was busy is measured again."""
        if self.plain is None or most <= 0:
            return 0
        prior = self.plain / 4
        row = (self.row if self.row is not None else prior) + guess
        best, best_rate, tokens = 0, 1.0 / self.plain, 1.0
        for k in range(1, min(most, MAX_DRAFT) + 1):
            tokens += rate ** k
            if (r := tokens / (self.plain + k * row)) > best_rate:
                best, best_rate = k, r
        if best == 0 and self.undrafted >= PROBE_AFTER and (1 + rate) / (self.plain + prior + guess) > 1 / self.plain:
            return 1
        return best
