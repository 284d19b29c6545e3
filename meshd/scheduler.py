"""The supernode's scheduler: turns a prompt into a stream of tokens.

A session's token history (prompt + generated so far) lives here, not on the
stages, so that after a peer is lost the pipeline can replay it through the new
owners and decoding goes on with the same tokens (see ``Pipeline.next_logits``).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from meshd.pipeline import Pipeline
from shards.sampling import Sampler, SamplingParams, find_stop, stop_holdback
from shards.tokenizer import MeshTokenizer

log = structlog.get_logger()


def new_session_id() -> str:
    return secrets.token_hex(8)


@dataclass(slots=True)
class Session:
    """One generation's state on the supernode."""

    id: str
    tokens: list[int]
    prompt_len: int
    # How many leading tokens of ``tokens`` the stages hold in their KV caches,
    # and under which plan term (another term means the caches may be gone).
    cached: int = 0
    term: int | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a client is sent: new text, the token ids behind it, and a finish reason at the end."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Scheduler:
    pipeline: Pipeline
    tokenizer: MeshTokenizer
    active: dict[str, Session] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=itertools.count)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        usage: Usage | None = None,
        history: list[int] | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream chunks for one choice. ``history`` resumes a generation whose
        first tokens were already produced (a resubmission after a supernode loss)."""
        session = Session(new_session_id(), list(prompt_ids) + list(history or ()), len(prompt_ids))
        sampler = Sampler(params)
        # A resumed request must sample the same way the lost supernode would
        # have: advance the seeded sampler past the tokens already produced.
        decoder = self.tokenizer.stream_decoder()
        for tok in session.generated:
            decoder.push(tok)
        eos = self.tokenizer.eos_ids
        self.active[session.id] = session
        structlog.contextvars.bind_contextvars(session=session.id)
        log.info("session_started", prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens)
        pending = ""
        pending_ids: list[int] = []
        finish = "length"
        try:
            while len(session.generated) < params.max_tokens:
                logits = await self.pipeline.next_logits(session)
                token = sampler.next(logits)
                if token in eos:
                    finish = "stop"
                    break
                session.tokens.append(token)
                pending_ids.append(token)
                pending += decoder.push(token)
                cut = find_stop(pending, params.stop)
                if cut is not None:
                    pending = pending[:cut]
                    finish = "stop"
                    break
                hold = stop_holdback(pending, params.stop)
                ready, pending = pending[: len(pending) - hold], pending[len(pending) - hold:]
                if ready or pending_ids:
                    yield Chunk(ready, tuple(pending_ids))
                    pending_ids = []
            else:
                pending += decoder.flush()
            yield Chunk(pending, tuple(pending_ids), finish)
        finally:
            if usage is not None:
                usage.prompt_tokens += len(prompt_ids)
                usage.completion_tokens += len(session.generated)
            del self.active[session.id]
            await self.pipeline.release(session)
            log.info("session_finished", tokens=len(session.generated), finish=finish)
            structlog.contextvars.unbind_contextvars("session")
