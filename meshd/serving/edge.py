"""The HTTP edge of the peer a client talks to: ``protocol.generate`` frames (from this
peer's own generation, or from the supernode over the sealed link) as OpenAI's answer,
one chunk per ``Delta`` or one JSON body, and what each choice has been sent, which a
resubmission to the next supernode goes on from (``request``).

Nothing else in meshd writes OpenAI's completion shapes, and nothing here reads them back.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from meshd.serving.openai import MAX_OUTPUTS, Assembler, completion_json
from protocol import generate as gen


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)  # every token it has, the client's own meshd_resume first
    finish: gen.Finish = gen.Finish.NONE
    own: int = 0  # leading tokens the client sent itself (meshd_resume): not answered back
    given: bool = False  # the client sent it as whole already (meshd_finished): not run
    sent: bool = False  # its first chunk went out (the role, the prompt's logprobs)
    offset: int = 0  # completions' text_offset so far


class Edge:
    """One client's completion: the frames in, its OpenAI chunks (``delta``, ``usage``) or
    whole answer (``whole``) out, and each choice's history."""

    def __init__(self, chat: bool, cid: str):
        self.chat, self.cid = chat, cid
        self.model: str | None = None
        self.fingerprint: str | None = None
        self.logprobs = False
        self.choices: dict[int, _Choice] = {}
        self.usage: dict | None = None
        self.skipped_tokens = 0  # of the choices already whole when the last request went out
        self._whole = Assembler(chat)

    # -- what the client has ---------------------------------------------------------

    def seed(self, index: int, ids: list[int], whole: bool = False) -> None:
        """Choice ``index`` begins with these tokens, the client's own (meshd_resume);
        ``whole``: the client has all of it (meshd_finished)."""
        self.choices[index] = _Choice(list(ids), own=len(ids), given=whole)

    def seed_from(self, msg: gen.Generate) -> None:
        """The client's own history, as its request carries it."""
        for i, h in enumerate(msg.resume):
            self.seed(i, list(h.token_ids), whole=i in msg.finished)
        for i in set(msg.finished) - set(self.choices):
            self.seed(i, [], whole=True)

    def tokens(self) -> int:
        """Tokens every choice has (the client's own meshd_resume included)."""
        return sum(len(c.ids) for c in self.choices.values())

    @property
    def first_ids(self) -> list[int]:
        return self.choices[0].ids if 0 in self.choices else []

    @property
    def generated(self) -> bool:
        return any(len(c.ids) > c.own for c in self.choices.values())

    @property
    def finished(self) -> bool:
        return bool(self.choices) and all(c.given or c.finish is not gen.Finish.NONE for c in self.choices.values())

    def request(self, first: gen.Generate) -> gen.Generate:
        """The request that goes on where this answer stopped: each choice's history, and
        the choices already whole (which the next supernode does not run again)."""
        if not self.choices:
            return first
        last = max(self.choices)
        resume = tuple(gen.History(tuple(self.choices[i].ids) if i in self.choices else ()) for i in range(last + 1))
        done = tuple(sorted(i for i, c in self.choices.items() if c.given or c.finish is not gen.Finish.NONE))
        # counted as the supernode counts a choice it runs (its tokens so far too); one the
        # client sent as whole is not counted, as a supernode it went to straight would not
        self.skipped_tokens = sum(len(self.choices[i].ids) for i in done if not self.choices[i].given)
        return dataclasses.replace(first, resume=resume, finished=done)

    # -- frames in, OpenAI out -------------------------------------------------------

    def begin(self, frame: gen.Begin) -> None:
        self.model, self.fingerprint, self.logprobs = frame.model, frame.fingerprint, bool(frame.logprobs)

    def delta(self, d: gen.Delta) -> dict | None:
        """The chunk a stream sends for ``d`` (None: nothing to send); the whole answer takes it too."""
        if not 0 <= d.choice < MAX_OUTPUTS:
            return None
        c = self.choices.setdefault(d.choice, _Choice())
        c.ids.extend(d.token_ids)
        if d.finish is not gen.Finish.NONE:
            c.finish = d.finish
        first = not c.sent
        if not (d.text or d.tool_calls or d.token_ids or d.finish or d.prompt_logprobs or first):
            return None
        c.sent = True
        lp = self._logprobs(c, d.logprobs, d.prompt_logprobs) if self.logprobs else None
        finish = d.finish.reason
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if d.text or first:
                delta["content"] = d.text
            if d.tool_calls:
                delta["tool_calls"] = [{"index": t.index, "id": t.id, "type": "function",
                                        "function": {"name": t.name, "arguments": t.arguments}} for t in d.tool_calls]
            choice = {"index": d.choice, "delta": delta, "logprobs": lp, "finish_reason": finish,
                      "token_ids": list(d.token_ids)}
        else:
            choice = {"index": d.choice, "text": d.text, "logprobs": lp, "finish_reason": finish,
                      "token_ids": list(d.token_ids)}
        chunk = {"id": self.cid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": int(time.time()), "model": self.model, "system_fingerprint": self.fingerprint,
                 "choices": [choice]}
        self._whole.add(chunk)
        return chunk

    def usage_chunk(self, u: gen.Usage) -> dict:
        """The stream's last chunk, with the usage (counting the choices it did not run again)."""
        completion = u.completion_tokens + self.skipped_tokens
        self.usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
                      "total_tokens": u.prompt_tokens + completion}
        out = completion_json(self.chat, self.cid, self.model, [], self.usage, self.fingerprint)
        out["object"] = "chat.completion.chunk" if self.chat else "text_completion"
        return out

    def whole(self) -> dict:
        """The whole answer (a client that did not ask for a stream)."""
        return completion_json(self.chat, self.cid, self.model, self._whole.choices(), self.usage, self.fingerprint)

    def _logprobs(self, c: _Choice, entries: tuple[gen.TokenLogprob, ...],
                  prompt: tuple[gen.TokenLogprob, ...]) -> dict:
        if self.chat:
            return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": list(e.raw),
                                 "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.raw)}
                                                  for t in e.top]} for e in entries],
                    "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in prompt + entries:
            out["tokens"].append(e.text)
            out["token_logprobs"].append(e.logprob if e.scored else None)
            out["top_logprobs"].append({t.text: t.logprob for t in e.top} if e.scored else None)
            out["text_offset"].append(c.offset)
            c.offset += len(e.text)
        return out
