"""A Spark client: map a DataFrame column of prompts (or chat messages) to completions
through the mesh, with the official OpenAI client inside ``mapInPandas``.

    from meshd.spark import complete, mesh_urls
    urls = mesh_urls("http://box1:8470")            # every live peer's API, from one peer
    out = complete(docs, "text", urls=urls, chat=True, system="Summarise in one sentence.",
                   output="summary", max_tokens=64)

``out`` is ``docs`` with four more columns: ``summary`` (the completion's text),
``summary_finish_reason``, ``summary_tokens`` and ``summary_error`` (null unless the
mesh refused that row, e.g. a prompt longer than the context: the job goes on).

Partition i sends its requests to ``urls[i % len(urls)]``, so the entry work (HTTP,
token history) spreads over the peers; inside a partition ``concurrency`` requests run
at once and the supernode's scheduler batches them. A request whose peer does not
answer (refused, reset, timed out, a 5xx) is sent again to the next peer, a bounded
number of times with backoff: a dead entry peer costs a retry, not the job. Greedy and
seeded requests give the same answer wherever they run. (Spark re-runs a failed task
as well; then its rows are asked again, which for these requests changes nothing.)

Needs the ``spark`` extra: ``pip install 'meshd[spark]'`` (pyspark, pandas, pyarrow,
openai) and a Java runtime.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

RETRIES = 8
BACKOFF_S = (0.5, 10.0)
log = logging.getLogger("meshd.spark")


def mesh_urls(url: str, timeout: float = 5.0) -> list[str]:
    """The API URL of every live peer of the mesh ``url`` belongs to (``url`` first), from its /status."""
    base = url.rstrip("/")
    with urllib.request.urlopen(base + "/status", timeout=timeout) as resp:
        status = json.loads(resp.read())
    scheme = urllib.parse.urlsplit(base).scheme or "http"
    urls = [base]
    for peer in status.get("peers", []):
        if peer.get("self") or peer.get("state") == "lost" or not peer.get("addr"):
            continue
        other = f"{scheme}://{peer['addr']}"
        if other not in urls:
            urls.append(other)
    return urls


def served_model(urls: list[str], timeout: float = 5.0) -> str:
    """The model the mesh serves, from the first of ``urls`` that answers."""
    last: OSError | None = None
    for url in urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
                return json.loads(resp.read())["data"][0]["id"]
        except OSError as exc:
            last = exc
    raise ConnectionError(f"no peer of {list(urls)} answered: {last}")


@dataclass(frozen=True)
class Request:
    """How every row is asked (picklable: it travels to the executors)."""

    column: str
    urls: tuple[str, ...]
    model: str
    chat: bool = False
    system: str | None = None
    output: str = "completion"
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = None
    concurrency: int = 4
    retries: int = RETRIES
    timeout: float = 600.0
    api_key: str | None = None

    def body(self, value) -> dict:
        """The request for one cell: a prompt string, or (chat) a string or a list of messages."""
        body: dict = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.seed is not None:
            body["seed"] = self.seed
        if not self.chat:
            body["prompt"] = value
            return body
        if isinstance(value, str):
            messages = [{"role": "user", "content": value}]
        else:  # array<struct<role, content>>: dicts through Arrow, Rows otherwise
            messages = [dict(m.asDict() if hasattr(m, "asDict") else m) for m in value]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        body["messages"] = messages
        return body


class MeshClient:
    """OpenAI clients for every peer, starting at ``start``; a request moves on to the
    next peer when its peer does not answer."""

    def __init__(self, req: Request, start: int = 0):
        import openai

        self.openai = openai
        self.req = req
        self.urls = req.urls
        self.clients = [openai.OpenAI(base_url=u.rstrip("/") + "/v1", api_key=req.api_key or "unused",
                                      max_retries=0, timeout=req.timeout) for u in req.urls]
        self.start = start % len(self.clients)

    def ask(self, value) -> tuple[str | None, str | None, int | None, str | None]:
        """(text, finish_reason, completion tokens, error) for one cell."""
        if value is None or (isinstance(value, float) and value != value):  # null, or pandas' NaN
            return None, None, None, "no input"
        openai, req = self.openai, self.req
        body = req.body(value)
        last = ""
        for attempt in range(req.retries):
            at = (self.start + attempt) % len(self.clients)
            client = self.clients[at]
            try:
                if req.chat:
                    answer = client.chat.completions.create(**body)
                    text = answer.choices[0].message.content
                else:
                    answer = client.completions.create(**body)
                    text = answer.choices[0].text
                return text, answer.choices[0].finish_reason, answer.usage.completion_tokens, None
            except (openai.APIConnectionError, openai.InternalServerError, openai.RateLimitError) as exc:
                # The peer is gone or cannot serve now: the next peer, after a pause per round.
                last = f"{type(exc).__name__}: {exc}"
                log.warning("meshd peer %s did not answer (%s); asking %s", self.urls[at], last,
                            self.urls[(at + 1) % len(self.urls)])
                if (attempt + 1) % len(self.clients) == 0:
                    low, high = BACKOFF_S
                    time.sleep(min(high, low * 2 ** ((attempt + 1) // len(self.clients) - 1)))
            except openai.APIStatusError as exc:  # the request itself was refused: that row's answer
                return None, None, None, f"HTTP {exc.status_code}: {exc.message}"
        return None, None, None, f"no peer answered after {req.retries} attempts: {last}"


def _map_partition(req: Request, frames: Iterator) -> Iterator:
    """mapInPandas: each pandas frame of the partition, with the answers as new columns."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    client = MeshClient(req, ctx.partitionId() if ctx is not None else 0)
    with ThreadPoolExecutor(req.concurrency) as pool:
        for frame in frames:
            answers = list(pool.map(client.ask, frame[req.column]))
            out = req.output
            yield frame.assign(**{out: [a[0] for a in answers], f"{out}_finish_reason": [a[1] for a in answers],
                                  f"{out}_tokens": [a[2] for a in answers], f"{out}_error": [a[3] for a in answers]})


def complete(df, column: str, *, urls: list[str], chat: bool = False, system: str | None = None,
             output: str = "completion", max_tokens: int = 256, temperature: float = 0.0, seed: int | None = None,
             model: str | None = None, concurrency: int = 4, retries: int = RETRIES, timeout: float = 600.0,
             api_key: str | None = None):
    """``df`` with the completion of each row's ``column`` (see the module doc for the columns)."""
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    if not urls:
        raise ValueError("urls: at least one peer's API URL (mesh_urls(url) lists them all)")
    if system is not None and not chat:
        raise ValueError("system goes with chat=True")
    req = Request(column, tuple(urls), model or served_model(urls), chat, system, output, max_tokens,
                  temperature, seed, concurrency, retries, timeout, api_key)
    schema = StructType(list(df.schema.fields) + [
        StructField(output, StringType()), StructField(f"{output}_finish_reason", StringType()),
        StructField(f"{output}_tokens", IntegerType()), StructField(f"{output}_error", StringType())])
    return df.mapInPandas(functools.partial(_map_partition, req), schema)
