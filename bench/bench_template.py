"""Chat template rendering: what the worker process costs a normal chat, and how long a bad
template takes to refuse (shards/template_sandbox.py).

On the real default model's tokenizer (SmolLM2, ChatML), in this process:

- ``jinja``: the compiled template rendered in-process (what rendering cost before);
- ``worker``: ``render_chat`` through a render worker (a pipe round trip on top);
- ``encode_chat``: render + tokenize, what a chat request pays before its prefill;
- ``spin``: a template of two nested ``range(100000)`` loops, refused at the time limit;
- ``after kill``: the next normal render (the killed worker's replacement starting);
- ``output``: a template writing 10^10 characters in pieces, refused at the output cap.

    .venv/bin/python bench/bench_template.py [--model DIR] [--n 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from locate import add_model_flag, need_model  # noqa: E402
from shards.chat import ChatTemplate, bounded_environment  # noqa: E402
from shards.template_sandbox import TemplateLimit, pool  # noqa: E402
from shards.tokenizer import MeshTokenizer  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is a mesh of small machines good for?"},
            {"role": "assistant", "content": "Serving a model none of them could hold alone."},
            {"role": "user", "content": "How does it split the layers?"}]


def timed(fn, n: int) -> tuple[float, float]:
    """p50 and p99 of ``fn()`` in ms."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def refused(template: ChatTemplate, **kw) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        template.render(MESSAGES, **kw)
    except TemplateLimit as exc:
        return (time.perf_counter() - start) * 1e3, exc.limit
    raise AssertionError("rendered")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_flag(ap)
    ap.add_argument("--n", type=int, default=500)
    args = ap.parse_args()
    tok = MeshTokenizer.load(need_model(args.model))
    pool().warm()
    tok.render_chat(MESSAGES)  # both workers up
    compiled = bounded_environment(1 << 24).from_string(tok.template.source)  # trusted: SmolLM2's own
    rows = [("jinja (in-process)", *timed(lambda: compiled.render(messages=MESSAGES, add_generation_prompt=True,
                                                                  **tok.special_tokens), args.n)),
            ("worker render_chat", *timed(lambda: tok.render_chat(MESSAGES), args.n)),
            ("encode_chat (render + tokenize)", *timed(lambda: tok.encode_chat(MESSAGES), args.n))]
    for name, p50, p99 in rows:
        print(f"{name:34s} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms")
    spin = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    ms, limit = refused(spin)
    print(f"{'spin refused':34s} {ms:7.1f} ms  ({limit})")
    start = time.perf_counter()
    tok.render_chat(MESSAGES)
    print(f"{'next render after the kill':34s} {(time.perf_counter() - start) * 1e3:7.1f} ms")
    pile = ChatTemplate("{% for a in range(100000) %}{{ 'y' * 100000 }}{% endfor %}")
    ms, limit = refused(pile, max_chars=8192 * tok.max_token_chars)
    print(f"{'output cap refused':34s} {ms:7.1f} ms  ({limit})")


if __name__ == "__main__":
    main()
