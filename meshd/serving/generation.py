"""A completion on the supernode, typed from end to end: a validated ``CompletionRequest``
in, ``protocol.generate`` frames out (``Begin``, each choice's ``Delta``s, ``Usage``,
``End``). The supernode's own HTTP edge turns the frames into OpenAI's JSON or SSE
(``meshd.serving.edge``); for a request an entry peer hands over, the frames go back to
it as they are (``serve_framed``), and its edge does the same.

Which of a choice's tokens are text, tool calls or logprobs is decided here, where the
tokenizer and the model's tool-call format are; how that looks to a client is the edge's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
from collections.abc import Awaitable, Callable

import structlog

from meshd import __version__
from meshd.errors import KNOWN_ERRORS, BadRequest, InvalidParams, NoCapacity, StorageFull, SupernodeChanged
from meshd.serving import toolcalls
from meshd.serving.openai import CompletionRequest, MeshCode
from meshd.serving.scheduler import Scheduler, Session, Usage
from protocol import generate as gen
from shards import grammar
from shards.sampling import TokenLogprobs

KEEPALIVE_S = 1.0
# An echoed prompt's logprobs go this many to a frame (a 32k-token prompt's with 20 top
# tokens each would be some 20 MB in one).
PROMPT_LOGPROBS_PER_DELTA = 1024
# A logprob the wire cannot carry (a token the grammar or top-k masked: -inf) travels as
# OpenAI writes such a one.
MASKED_LOGPROB = -9999.0

log = structlog.get_logger()

Emit = Callable[[gen.Output], Awaitable[None]]


def fingerprint(model: str) -> str:
    """system_fingerprint: which build and model made an answer (changes when either does)."""
    return "fp_" + hashlib.sha256(f"meshd {__version__} {model}".encode()).hexdigest()[:12]


def token_texts(tokenizer) -> Callable[[int], tuple[str, bytes]]:
    """A token's text (invalid UTF-8 replaced) and its bytes, cached per tokenizer use."""
    @functools.lru_cache(maxsize=4096)
    def text(token: int) -> tuple[str, bytes]:
        raw = grammar.token_bytes(tokenizer, token)
        return raw.decode("utf-8", "replace"), raw
    return text


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


class ChoiceDeltas:
    """One choice's scheduler chunks as ``Delta`` frames: tool calls parsed out of the text
    in the model's format, the echo (completions) before its first text, logprobs with
    each token's text and bytes."""

    def __init__(self, req: CompletionRequest, index: int, token_text: Callable[[int], tuple[str, bytes]],
                 echo: str = "", resumed_text: str = ""):
        self.req, self.index, self.token_text = req, index, token_text
        tools = req.tools
        self.parser = toolcalls.CallParser(tools.fmt) if tools is not None and tools.choice != "none" else None
        self.first = True
        self.calls = 0  # tool calls of this choice so far: the next one's index
        if self.parser is not None and resumed_text:
            # Sent before a resubmission: the parser's state, and the calls already made
            # (the next one goes on from their count; a choice that made one ends as tool_calls).
            self.calls = len(self.parser.push(resumed_text)[1])
        self.echo = echo

    def deltas(self, text: str, token_ids: tuple[int, ...], logprobs, finish: str | None,
               prompt_logprobs=()) -> list[gen.Delta]:
        """The frames for one chunk: one, or, where an echoed prompt's logprobs are many,
        frames of its logprobs alone before it."""
        d = self._delta(text, token_ids, logprobs, finish, prompt_logprobs)
        if d is None:
            return []
        if len(d.prompt_logprobs) <= PROMPT_LOGPROBS_PER_DELTA:
            return [d]
        n, per = len(d.prompt_logprobs), PROMPT_LOGPROBS_PER_DELTA
        parts = [d.prompt_logprobs[i:i + per] for i in range(0, n, per)]
        return [gen.Delta(self.index, prompt_logprobs=p) for p in parts[:-1]] + \
            [dataclasses.replace(d, prompt_logprobs=parts[-1])]

    def _delta(self, text: str, token_ids: tuple[int, ...], logprobs, finish: str | None,
               prompt_logprobs=()) -> gen.Delta | None:
        calls: list[toolcalls.ToolCall] = []
        if self.parser is not None:
            text, calls = self.parser.push(text)
            if finish is not None:
                rest, more = self.parser.end()
                text, calls = text + rest, calls + more
        if finish == "stop" and (calls or self.calls):
            finish = "tool_calls"
        if self.echo:
            text, self.echo = self.echo + text, ""
        if not (text or calls or token_ids or finish or self.first):
            return None
        logged = self.req.params.logprobs is not None
        out = gen.Delta(
            self.index, text, tuple(token_ids),
            logprobs=tuple(self._entry(e) for e in logprobs) if logged else (),
            prompt_logprobs=self._prompt(prompt_logprobs) if logged and self.first else (),
            tool_calls=tuple(gen.ToolCallDelta(self.calls + k, c.id, c.name, c.arguments)
                             for k, c in enumerate(calls)),
            finish=gen.Finish.of(finish))
        self.first = False
        self.calls += len(calls)
        return out

    def _entry(self, e: TokenLogprobs) -> gen.TokenLogprob:
        text, raw = self.token_text(e.token)
        top = tuple(gen.TopLogprob(t, *self.token_text(t), _finite(v)) for t, v in e.top)
        return gen.TokenLogprob(e.token, text, raw, _finite(e.logprob), top)

    def _prompt(self, scores) -> tuple[gen.TokenLogprob, ...]:
        """The echoed prompt's logprobs (completions): its first token has none (OpenAI's
        and vLLM's answers show it as null), then one entry per later token."""
        if self.req.params.prompt_logprobs is None:
            return ()
        first = self.req.prompts[self.index // self.req.n][0]
        return (gen.TokenLogprob(first, *self.token_text(first), scored=0),) + tuple(self._entry(e) for e in scores)


def prompt_tokens(req: CompletionRequest) -> int:
    return sum(len(p) for p in req.prompts) * req.n


async def run(scheduler: Scheduler, observe, req: CompletionRequest, sessions: dict[int, Session], tokenizer,
              emit: Emit) -> None:
    """Every choice's frames through ``emit`` as they come (choices interleaved; a
    ``Keepalive`` each second none does), ``Begin`` first, ``Usage`` and ``End`` last.
    A choice's failure (one of KNOWN_ERRORS) and ``emit``'s own (a client gone) end the
    others and are raised (the first of them, a client gone before any other)."""
    await emit(gen.Begin(req.model, fingerprint(req.model), int(req.params.logprobs is not None)))
    queue: asyncio.Queue[gen.Delta | None] = asyncio.Queue()
    usage = Usage()
    text = token_texts(tokenizer)

    async def one(index: int) -> None:
        try:
            resume = req.resume_of(index)
            echo = req.prompt_texts[index // req.n] if req.echo and not req.resumed else ""
            deltas = ChoiceDeltas(req, index, text, echo, tokenizer.decode(list(resume)) if resume else "")
            async for chunk in observe(scheduler.stream(sessions[index], usage)):
                for d in deltas.deltas(chunk.text, chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                                       chunk.prompt_logprobs):
                    await queue.put(d)
        finally:
            await queue.put(None)

    async def pump() -> None:
        finished = 0
        while finished < len(sessions):
            try:
                async with asyncio.timeout(KEEPALIVE_S):  # no task per frame, as wait_for makes
                    item = await queue.get()
            except TimeoutError:
                await emit(gen.Keepalive())
                continue
            if item is None:
                finished += 1
            else:
                await emit(item)

    try:
        async with asyncio.TaskGroup() as tg:
            for i in sessions:
                tg.create_task(one(i))
            tg.create_task(pump())
    except BaseExceptionGroup as group:
        # The client gone before any other (nobody is left to tell), then a known error;
        # anything else is a bug, raised as it is.
        leaves = list(_leaves(group))
        for kind in (ConnectionResetError, KNOWN_ERRORS):
            if first := next((e for e in leaves if isinstance(e, kind)), None):
                if len(leaves) > 1:
                    log.info("generation_errors", raised=repr(first), others=[repr(e) for e in leaves if e is not first])
                raise first from None
        raise
    await emit(gen.Usage(prompt_tokens(req), usage.completion_tokens))
    await emit(gen.End())


def _leaves(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


def failure_of(exc: BaseException, during: bool = False) -> gen.Failure:
    """An error as the entry peer gets it: OpenAI's fields, and what it does about it.
    ``during``: the answer had begun (the failure of a generation, not of the request)."""
    match exc:
        case SupernodeChanged():
            return gen.Failure(gen.Act.MOVED, 503, f"the mesh cannot serve now: {exc}",
                               code=MeshCode.SUPERNODE_CHANGED)
        case NoCapacity():
            why = f"generation failed: {exc}" if during else f"the mesh cannot serve now: {exc}"
            return gen.Failure(gen.Act.UNAVAILABLE, 503, why, code=MeshCode.MESH_UNAVAILABLE)
        case BadRequest() if not during:
            return gen.Failure(gen.Act.FAIL, exc.status, str(exc), exc.param or "", exc.code or "")
        case InvalidParams():
            return gen.Failure(gen.Act.FAIL, 400, f"generation failed: {exc}" if during else str(exc), exc.param or "")
        case StorageFull() if not during:
            return gen.Failure(gen.Act.FAIL, 507, str(exc))
    return gen.Failure(gen.Act.FAIL, 500, f"generation failed: {exc}" if during else str(exc))
