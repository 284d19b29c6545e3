"""A choice's tokens into what its client is sent: text decoded in whole characters,
stop strings found (and held back while they may still be forming), each token's
logprobs kept beside it, and the finish reason.

The scheduler only schedules: it puts a session's token ids on its queue and ends it.
This part turns them into ``Chunk``s on the consumer's side; ``generation.ChoiceDeltas``
turns chunks into typed ``Delta`` frames (tool calls parsed out), and the HTTP edge of
the peer the client talks to (``edge.Edge``) turns those into OpenAI's JSON or SSE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shards.sampling import SamplingParams, TokenLogprobs, find_stop, stop_holdback
from shards.tokenizer import MeshTokenizer


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a client is sent: new text, the token ids behind it, and a finish reason at the end."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when asked for
    # The first chunk's, when asked for: the prompt's tokens after the first, scored
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class ChoiceOutput:
    """One choice's output, token by token. ``resumed``: tokens it already had (a
    resubmission's history), decoded so that the text goes on where it stopped but not
    sent again. Stop strings count from the ``min_tokens``-th token on (vLLM's rule)."""

    def __init__(self, tokenizer: MeshTokenizer, params: SamplingParams, resumed: Sequence[int] = ()):
        self.params = params
        self.decoder = tokenizer.stream_decoder()
        for tok in resumed:
            self.decoder.push(tok)
        self.delivered = len(resumed)  # tokens of the choice so far, resumed ones included
        self.finish: str | None = None  # "stop" once a stop string ended it
        self._text = ""  # decoded, not yet sent (a stop string may be forming)
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        # The prompt's scores where asked for, once they are in: they go with the next chunk.
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def push(self, token: int, logprobs: TokenLogprobs | None = None) -> Chunk | None:
        """Take the next token: the chunk ready to send (None: nothing yet, or a stop
        string ended the choice; then ``finish`` is "stop" and ``end`` gives the last chunk)."""
        if logprobs is not None:
            self._logprobs.append(logprobs)
        self.delivered += 1
        self._ids.append(token)
        self._text += self.decoder.push(token)
        stops = self.params.stop if self.delivered >= self.params.min_tokens else ()
        if (cut := find_stop(self._text, stops)) is not None:
            self._text, self.finish = self._text[:cut], "stop"
            return None
        hold = stop_holdback(self._text, stops)
        ready, self._text = self._text[: len(self._text) - hold], self._text[len(self._text) - hold:]
        return self._take(ready, None) if ready or self._ids else None

    def end(self, finish: str) -> Chunk:
        """The last chunk: what was held back (all of the text where the answer ran to its
        length; a held-back stop string's start where it was a stop) and the finish reason."""
        if finish == "length":
            self._text += self.decoder.flush()
        self.finish, text, self._text = finish, self._text, ""
        return self._take(text, finish)

    def _take(self, text: str, finish: str | None) -> Chunk:
        chunk = Chunk(text, tuple(self._ids), finish, tuple(self._logprobs), self.prompt_logprobs)
        self._ids, self._logprobs, self.prompt_logprobs = [], [], ()
        return chunk
