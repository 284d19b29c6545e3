"""A draft model for speculative decoding (``--draft-model``): a small model with the
target's tokenizer, whole on the supernode, that guesses a session's next tokens greedily
where prompt lookup has no guess (free text). The pipeline checks the guess exactly as it
checks a lookup draft (one row per drafted token in the step it runs anyway; the model's
own picks are kept), so the answer is the same tokens with or without it; only the speed
differs. As vLLM's and transformers' assisted generation, across the mesh's stages.

The draft model keeps a KV cache per session in its own engine (its own worker thread):
each call feeds only the tokens the session gained since the last one (those taken from the
last draft, and the model's own token after them), cutting its cache back to where the
guess and the session parted. A session's prompt is fed beside the lanes (``warm``, in
chunks), once its first draft would pay: its model drafts wait for that, not the lane's
steps, so a long prompt's first draft never holds every stream of its lane.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Coroutine
from pathlib import Path

import structlog

from meshd.serving.lookup import EMA, Acceptance
from shards.engine import StageEngine
from shards.errors import ModelError
from shards.manifest import TOKENIZER_FILE, Manifest
from shards.span import Span

log = structlog.get_logger()

MAX_SESSIONS = 256  # draft caches kept; the least recently drafted goes first beyond this
WARM_CHUNK = 256  # prompt rows a call of ``warm`` feeds: other sessions' drafts run between calls


class DraftModel:
    def __init__(self, engine: StageEngine):
        self.engine = engine
        self.name = engine.manifest.name
        self.context = engine.manifest.config.max_position
        self.vocab = engine.manifest.config.vocab_size
        self._known: dict[str, list[int]] = {}  # session -> the tokens its draft cache holds, in use order
        self._lock = threading.Lock()  # _known, _warming: drafts on the engine's thread, forget on the loop's
        self._warming: set[str] = set()  # sessions whose prompt ``warm`` is feeding
        self.token_s = 0.0  # seconds a row fed to it costs here (a moving average; 0 before the first)
        # How often its drafted tokens are taken, over every session (how well it guesses is
        # the pair of models' more than a session's); hopeful at first, so that it is tried.
        self.acceptance = Acceptance(taken=3.0, missed=1.0)

    @classmethod
    def load(cls, model_dir: Path, target: Manifest, device: str = "auto", dtype: str = "auto") -> DraftModel:
        """The draft model in ``model_dir``, whole, refused unless its tokenizer is the
        target's (the same file) and its vocabulary no larger (a token id of one means
        the same text in the other)."""
        manifest = Manifest.load(model_dir)
        mine, theirs = manifest.files.get(TOKENIZER_FILE), target.files.get(TOKENIZER_FILE)
        if mine is None or theirs is None or mine.sha256 != theirs.sha256:
            raise ModelError(f"draft model {manifest.name!r} does not have the tokenizer of {target.name!r}")
        if manifest.config.vocab_size > target.config.vocab_size:
            raise ModelError(f"draft model {manifest.name!r} has a larger vocabulary than {target.name!r}")
        # One thread: a second worker running torch's parallel regions on several threads
        # would make libgomp stop spinning for the stage's own (shards/engine.py default_threads).
        engine = StageEngine.load(model_dir, Span(0, manifest.n_layers), True, True, device, dtype, threads=1)
        return cls(engine)

    async def draft(self, session: str, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens the draft model picks greedily after ``tokens`` (none where they
        would pass its context)."""
        if k <= 0 or not tokens or len(tokens) + k > self.context or max(tokens) >= self.vocab:
            return []  # (a target's id past a smaller draft vocabulary: its padding, or a client's)
        out, fed, seconds = await self.engine.run(lambda: self._greedy(session, tokens, k))
        took = seconds / fed  # per row, on the engine's thread (not the wait behind a warm's chunk)
        self.token_s = took if not self.token_s else (1 - EMA) * self.token_s + EMA * took
        return out

    def _greedy(self, session: str, tokens: list[int], k: int) -> tuple[list[int], int, float]:
        """The draft, how many rows it fed the model, and the seconds that took (on the
        engine's thread)."""
        t0 = time.perf_counter()
        with self._lock:
            known = self._known.pop(session, [])
        same = 0
        for a, b in zip(known, tokens):
            if a != b:
                break
            same += 1
        start = min(same, len(tokens) - 1, self.engine.cached_length(session))  # the last row gives the first guess
        e = self.engine
        x = e._forward_batch([(session, start, len(tokens) - start)], e._embed(tokens[start:]))
        out = [int(e._head(x[-1:])[0].argmax())]
        while len(out) < k:
            x = e._forward_batch([(session, len(tokens) + len(out) - 1, 1)], e._embed(out[-1:]))
            out.append(int(e._head(x)[0].argmax()))
        with self._lock:
            self._known[session] = tokens + out[:-1]  # what its cache holds now
            # the least recently drafted beyond MAX_SESSIONS (not one whose prompt still feeds)
            idle = [s for s in self._known if s not in self._warming]
            evicted = idle[:max(0, len(self._known) - MAX_SESSIONS)]
            for oldest in evicted:
                del self._known[oldest]
        for oldest in evicted:
            e.drop(oldest)
        return out, len(tokens) - start + k - 1, time.perf_counter() - t0

    def ready(self, session: str) -> bool:
        """Whether the session may draft now: its draft cache follows it (``warm`` fed its
        prompt, or a draft since), not while ``warm`` feeds."""
        with self._lock:
            return session in self._known and session not in self._warming

    def warm(self, session: str, tokens: list[int]) -> Coroutine[None, None, None]:
        """Feed a session's tokens but the last (which its first draft feeds) to its draft
        cache: the coroutine to run beside the lanes. From this call until it ends the
        session is not ``ready``, nor warmed again (``warming``)."""
        with self._lock:
            self._warming.add(session)
        return self._warm(session, list(tokens))

    def warming(self, session: str) -> bool:
        return session in self._warming

    async def _warm(self, session: str, tokens: list[int]) -> None:
        try:
            end = len(tokens) - 1
            if end <= 0 or len(tokens) > self.context or max(tokens) >= self.vocab:
                with self._lock:  # nothing to feed: ready (``draft`` feeds or declines it), not warmed again
                    if session in self._warming:
                        self._known[session] = []
                return
            for start in range(0, end, WARM_CHUNK):
                n = min(WARM_CHUNK, end - start)
                fed = await self.engine.run(functools.partial(self._feed, session, tokens, start, n))
                with self._lock:
                    gone = session not in self._warming
                if gone:  # forgotten meanwhile: ``forget`` left its cache to this
                    self.engine.drop(session)
                    return
                if not fed:  # its cache went under it (a drop_all): its first draft feeds the rest
                    return
        finally:
            with self._lock:
                self._warming.discard(session)

    def _feed(self, session: str, tokens: list[int], start: int, n: int) -> bool:  # on the engine's thread
        """Rows start..start+n-1 into the session's draft cache; False where the cache
        does not hold the rows before them (nothing fed)."""
        e = self.engine
        with self._lock:
            if session not in self._warming or e.cached_length(session) != start:
                return False
        e._forward_batch([(session, start, n)], e._embed(tokens[start:start + n]))
        with self._lock:
            if session in self._warming:
                self._known[session] = tokens[:start + n]
        return True

    def forget(self, session: str) -> None:
        """The session ended: its draft cache goes (once ``warm`` is through with it, where
        it is still feeding the prompt)."""
        with self._lock:
            self._known.pop(session, None)
            warming = session in self._warming
            self._warming.discard(session)
        if not warming:
            self.engine.drop(session)

    def close(self) -> None:
        self.engine.close()
