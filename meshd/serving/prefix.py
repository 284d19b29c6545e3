"""The supernode's prefix cache: the KV of finished sessions, kept on every stage.

A finished session's stage caches are not dropped: they stay on every stage under
the session's cache key, and this index remembers which tokens they hold and under
which plan term. A new session whose tokens start with what an entry holds takes
that entry over (its stages cut the cache back to the common prefix and append the
rest), so turn 2 of a chat prefills only what turn 1 did not already hold. An entry
is used by one session at a time: taking it removes it here, and when that session
ends its longer cache becomes the entry for turn 3.

Entries count against the scheduler's KV budget by the memory their caches hold: a
stage's cache grows in whole chunks of positions (``KV_CHUNK``) and keeps them when cut
back, so an entry counts its peak length rounded up to a chunk, and the session that
takes it over holds at least that. The least recently used entry is evicted
(its caches dropped on the stages) when a new request needs the room, when there are
more than ``max_entries``, and every entry of another term as soon as the term moves
on (a new plan may have moved the spans: its caches are gone or stale).

Pure bookkeeping: the caller drops the evicted keys on the stages.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shards.layers import KVCache

# A shorter common prefix is not worth taking an entry over (and truncating it away
# from the conversation it belongs to).
MIN_REUSE = 16
KV_CHUNK = KVCache.CHUNK  # positions a stage's cache grows by (and never gives back)


@dataclass(frozen=True, slots=True)
class Entry:
    tokens: tuple[int, ...]  # what the stages' caches hold, position by position
    term: int
    held: int  # positions of memory its caches hold (whole chunks)


@dataclass(frozen=True, slots=True)
class Hit:
    key: str  # the stages' cache key to take over
    reuse: int  # leading positions not to compute again
    held: int  # positions of memory the entry held (its share of the budget, now the session's)


def common_prefix(a: tuple[int, ...] | list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self.tokens = 0  # positions cached by all entries
        self.held = 0  # positions of memory their caches hold: what counts against the KV budget
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def stale(self, term: int | None) -> list[str]:
        """Forget every entry not of ``term`` (None: all of them); their keys, to drop."""
        gone = [key for key, e in self._entries.items() if e.term != term]
        for key in gone:
            self._remove(key)
        return gone

    def find(self, tokens: list[int], term: int) -> Hit | None:
        """The entry sharing the longest prefix with ``tokens`` (leaving at least the
        last token to compute: its logits are the answer), if worth taking."""
        best: Hit | None = None
        for key, e in self._entries.items():
            if e.term != term:
                continue
            reuse = min(common_prefix(e.tokens, tokens), len(tokens) - 1)
            if reuse >= MIN_REUSE and (best is None or reuse > best.reuse):
                best = Hit(key, reuse, e.held)
        return best

    def take(self, hit: Hit) -> None:
        """The session that found ``hit`` was admitted: the entry is its own now."""
        self._remove(hit.key)
        self.hits += 1
        self.tokens_saved += hit.reuse

    def miss(self) -> None:
        self.misses += 1

    def put(self, key: str, tokens: list[int], term: int, peak: int = 0) -> list[str]:
        """Keep a finished session's caches, which reached ``peak`` positions (drafts
        checked past its tokens, a longer entry it took over); the keys evicted to stay
        within max_entries."""
        if not self.enabled or not tokens:
            return [key]
        self._remove(key)
        entry = Entry(tuple(tokens), term, KVCache.room_for(max(peak, len(tokens))))
        self._entries[key] = entry
        self.tokens += len(tokens)
        self.held += entry.held
        evicted: list[str] = []
        while len(self._entries) > self.max_entries:
            if (gone := self.evict_one()) is not None:  # always: there are entries past max_entries
                evicted.append(gone)
        return evicted

    def evict_one(self, keep: str | None = None) -> str | None:
        """Evict the least recently used entry other than ``keep``; its key, or None."""
        key = next((k for k in self._entries if k != keep), None)
        if key is not None:
            self._remove(key)
            self.evictions += 1
        return key

    def _remove(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.tokens -= len(e.tokens)
            self.held -= e.held

    def stats(self) -> dict:
        return {"entries": len(self._entries), "tokens": self.tokens, "held": self.held, "hits": self.hits,
                "misses": self.misses,
                "tokens_saved": self.tokens_saved, "evictions": self.evictions}
