"""A model file cannot stall or own a peer through its chat template (issue 32, items 1, 2, 6).

The model here is the real SmolLM2 GGUF with its ``tokenizer.chat_template`` replaced (with
the ``gguf`` package) by one that renders ChatML, as the real one does, until the last
message is a trigger word: ``spin`` runs two nested ``range(100000)`` loops (hours),
``huge`` asks for a 2 GB string, ``pile`` writes 10^10 characters in pieces, ``hush``
renders nothing. It converts like any model. Two ``meshd run`` processes serve it: ``alpha``
(the supernode, which renders) and ``beta`` (a member a client may talk to). An attacker,
a process of its own, sends each trigger through /v1/chat/completions and /tokenize on both;
each is a 400 in OpenAI's error shape whose code names the limit it passed, while an honest
client's /healthz and short completion are answered within a second throughout, and the
mesh never re-plans. /tokenize and /detokenize work on the member, check the prompt bound
before tokenizing, and a template that renders nothing is a 400, not a 500.

GGUF metadata that sizes the model is checked at conversion: a 2^28 context is refused
there (serving would take it at its word) and in a manifest that claims it.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from meshd.errors import ModelError
from shards.chat_templates import CHATML
from shards.config import MAX_CONTEXT, ModelConfig
from shards.convert import convert
from shards.manifest import Manifest
from shards.template_sandbox import RenderPool, TemplateLimit
from shards.tokenizer import MeshTokenizer
from tests.fixtures.daemon import start_daemon, status_json, stop_daemon

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600)]

GiB = 1 << 30
LIMIT_CODES = {"chat_template_time_limit", "chat_template_output_limit", "chat_template_memory_limit"}
TRIGGERS = {  # the last message's text -> the limit its render passes
    "spin": "chat_template_time_limit",
    "huge": "chat_template_output_limit",
    "pile": "chat_template_output_limit",
}
HOSTILE = (
    "{%- set last = messages[-1]['content'] -%}"
    "{%- if last == 'spin' -%}{%- for a in range(100000) -%}{%- for b in range(100000) -%}{%- endfor -%}"
    "{%- endfor -%}"
    "{%- elif last == 'huge' -%}{%- set s = 'x' * 2000000000 -%}{{ s }}"
    "{%- elif last == 'pile' -%}{%- for a in range(100000) -%}{{ 'y' * 100000 }}{%- endfor -%}"
    "{%- elif last == 'hush' -%}"
    "{%- else -%}" + CHATML + "{%- endif -%}"
)
HELLO = [{"role": "user", "content": "Hello!"}]
HEALTHZ_S = HONEST_S = 1.0


def hostile_gguf(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` (every tensor and key) with ``template`` as its chat template."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {"tokenizer.chat_template": MetadataDetails(gguf.GGUFValueType.STRING,
                                                                                       template)}, [])
    return dst


@pytest.fixture(scope="module")
def hostile_dir(real_gguf_path, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("hostile")
    gguf_path = hostile_gguf(real_gguf_path, base / "hostile.gguf", HOSTILE)
    out = convert(gguf_path, base / "model", progress=False)  # converts like any model: its template is data
    assert Manifest.load(out).chat_template == HOSTILE
    return out


@pytest.fixture(scope="module")
def mesh(hostile_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile-mesh")
    secret = base / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    alpha = start_daemon(hostile_dir, base / "alpha", base / "alpha.log", "--name", "alpha", "--secret-file",
                         str(secret), "--advertise-vram", str(8 * GiB))
    try:
        beta = start_daemon(hostile_dir, base / "beta", base / "beta.log", "--name", "beta", "--secret-file",
                            str(secret), "--advertise-vram", str(4 * GiB), "--peer",
                            alpha.url.removeprefix("http://"))
        try:
            deadline = time.monotonic() + 90
            while status_json(beta.url).get("supernode") != status_json(alpha.url)["node"]["id"]:
                assert time.monotonic() < deadline, "beta never followed alpha"
                time.sleep(0.2)
            yield alpha, beta
        finally:
            stop_daemon(beta.proc)
    finally:
        stop_daemon(alpha.proc)


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status


# The attacker: a process of its own, two requests at a time (both render workers busy).
ATTACKER = r"""
import json, sys, urllib.request, urllib.error
from concurrent.futures import ThreadPoolExecutor
urls, triggers = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def send(job):
    url, path, word = job
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": word}]}
    if path == "/v1/chat/completions":
        body["max_tokens"] = 4
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return [url, path, word, resp.status, json.loads(resp.read())]
    except urllib.error.HTTPError as exc:
        return [url, path, word, exc.code, json.loads(exc.read())]
jobs = [(u, p, w) for w in triggers for u in urls for p in ("/v1/chat/completions", "/tokenize")]
with ThreadPoolExecutor(2) as pool:
    print(json.dumps(list(pool.map(send, jobs))))
"""


def honest_round(mesh, body: dict, timeout: float) -> float:
    """/healthz (within a second: the event loop) and a short completion on each peer; the
    slowest completion's seconds."""
    slowest = 0.0
    for p in mesh:
        assert get(p.url + "/healthz", timeout=HEALTHZ_S) == 200
        start = time.perf_counter()
        status, data = post(p.url + "/v1/completions", body, timeout=timeout)
        slowest = max(slowest, time.perf_counter() - start)
        assert status == 200 and data["usage"]["completion_tokens"] == body["max_tokens"], data
    return slowest


def test_hostile_template_is_refused_while_an_honest_client_is_served(mesh):
    alpha, beta = mesh
    honest = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
    # The honest client's bound: a second, or three times its slowest answer before the
    # attack where the box is that busy (other test runs share these 2 cores: answers of
    # 1.5-1.8 s with no attack at all were seen, and the same spread during one). A
    # template that held the tokenize thread made it wait for good, not a few seconds.
    bound = max(HONEST_S, 3 * max(honest_round(mesh, honest, 60) for _ in range(8)))
    before = status_json(alpha.url)
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, json.dumps([alpha.url, beta.url]),
                                 json.dumps(list(TRIGGERS))], stdout=subprocess.PIPE, text=True)
    rounds = 0
    try:
        while attacker.poll() is None:
            honest_round(mesh, honest, bound)  # the urllib timeout is the bound
            rounds += 1
        out, _ = attacker.communicate(timeout=60)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert rounds >= 1  # the attack lasted a while: the honest client was served during it
    results = json.loads(out)
    assert len(results) == len(TRIGGERS) * 2 * 2
    for url, path, word, status, data in results:
        err = data.get("error") or {}
        assert status == 400 and err.get("code") == TRIGGERS[word], (url, path, word, status, data)
        assert err["type"] == "invalid_request_error" and err["param"] == "messages"
        assert "limit" in err["message"], err
    after = status_json(alpha.url)
    assert after["term"] == before["term"] and after["plan"] == before["plan"]  # no re-plan: nobody missed beats
    assert all(p["state"] == "ready" for p in after["peers"]), after["peers"]
    # ...and it renders its honest chats as ChatML still.
    status, data = post(beta.url + "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "temperature": 0})
    assert status == 200 and data["choices"][0]["message"]["content"], data


def test_tokenize_and_detokenize_on_a_member(mesh, hostile_dir):
    alpha, beta = mesh
    tok = MeshTokenizer.load(hostile_dir)
    want = tok.encode(CHATML_HELLO)
    for p in (alpha, beta):
        status, data = post(p.url + "/tokenize", {"prompt": "Hello, mesh!"})
        assert status == 200 and data["tokens"] == tok.encode("Hello, mesh!", True), data
        status, text = post(p.url + "/detokenize", {"tokens": data["tokens"]})
        assert status == 200 and text["prompt"] == "Hello, mesh!", text
        status, data = post(p.url + "/tokenize", {"messages": HELLO})
        assert status == 200 and data["tokens"] == want and data["max_model_len"] == 8192, data
        status, data = post(p.url + "/detokenize", {"tokens": [-1]})
        assert status == 400 and data["error"]["param"] == "tokens", data


CHATML_HELLO = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_renders_nothing_is_a_400(mesh):
    for p in mesh:
        for path in ("/v1/chat/completions", "/tokenize"):
            status, data = post(p.url + path, {"messages": [{"role": "user", "content": "hush"}]})
            assert status == 400, (p.url, path, status, data)
            assert data["error"]["param"] == "messages" and "empty prompt" in data["error"]["message"], data


def test_tokenize_checks_the_prompt_bound_before_tokenizing(mesh, hostile_dir):
    tok = MeshTokenizer.load(hostile_dir)
    too_long = "a" * (8192 * tok.max_token_chars + 1)
    for p in mesh:
        for body, param in (({"prompt": too_long}, "prompt"),
                            ({"messages": [{"role": "user", "content": too_long}]}, "messages")):
            status, data = post(p.url + "/tokenize", body)
            assert status == 400 and data["error"]["param"] == param, data
            assert "context window of 8192 tokens" in data["error"]["message"], data


# -- the render pool on its own ----------------------------------------------------------------


SPIN = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


def test_an_honest_render_does_not_wait_for_spinning_ones():
    """Two renders spin in their workers; a ChatML render meanwhile gets a worker of its own
    and returns while they still spin; then each spin is refused at the time limit, its
    worker killed (gone from the process table) and replaced."""
    pool = RenderPool()
    pool.warm(3)
    try:
        outcomes: list[str] = []

        def spin() -> None:
            try:
                pool.render(SPIN, {"messages": []}, 1000)
            except TemplateLimit as exc:
                outcomes.append(exc.limit)

        spinners = [threading.Thread(target=spin) for _ in range(2)]
        for t in spinners:
            t.start()
        time.sleep(0.2)  # both taken
        text = pool.render(CHATML, {"messages": HELLO, "add_generation_prompt": True}, 1000)
        assert text == CHATML_HELLO
        assert any(t.is_alive() for t in spinners) and not outcomes  # it did not wait for them
        killed = [w.proc for w in pool._workers]
        for t in spinners:
            t.join(30)
        assert outcomes == ["chat_template_time_limit"] * 2
        assert sum(proc.poll() is not None for proc in killed) == 2  # those two were killed...
        assert pool.render(CHATML, {"messages": HELLO, "add_generation_prompt": True}, 1000) == CHATML_HELLO
    finally:
        pool.close()


@pytest.mark.parametrize("source, error", [
    ("{{ 'x' * 2000000000 }}", "chat_template_output_limit"),
    ("{{ 9 ** 99999 }}", "chat_template_output_limit"),
    ("{{ '%2000000000d' % 1 }}", "chat_template_memory_limit"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ '\\ud800' }}", "not valid Unicode"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_what_a_template_cannot_do_is_a_model_error_naming_it(source, error):
    from shards.chat import ChatTemplate

    with pytest.raises(ModelError) as caught:
        ChatTemplate(source).render(HELLO, max_chars=1 << 20)
    assert error in (getattr(caught.value, "limit", "") or str(caught.value)), caught.value


def test_compiling_a_template_runs_nothing_in_the_daemon():
    """Jinja folds constant expressions while it compiles and while it finds the names a
    template reads: ``{{ '%2000000000d' % 1 }}`` built a 2 GB string in the daemon at start
    (``check``) before any chat. Both happen in a worker now, under its memory limit (where
    the folding fails and is left to the render, which is refused); this process never
    holds such a string; a template that does not compile is a ModelError that says so."""
    import resource

    from shards.chat import ChatTemplate

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    for folded in ("{{ '%2000000000d' % 1 }}", "{{ 'x'|center(2000000000) }}", "{% set s = '%2000000000d' % 1 %}"):
        template = ChatTemplate(folded)
        template.check()
        with pytest.raises(TemplateLimit) as caught:
            template.render(HELLO)
        assert caught.value.limit in LIMIT_CODES, caught.value
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 << 10  # not 2 GB more
    with pytest.raises(ModelError, match=r"\(model\) does not compile: .*endfor"):
        ChatTemplate("{% for m in messages %}").check()
    assert ChatTemplate(CHATML).variables >= {"messages", "add_generation_prompt"}


# -- metadata sanity at conversion -----------------------------------------------------------


def tiny_gguf(path: Path, **overrides) -> Path:
    """A one-layer llama GGUF whose metadata says what ``overrides`` say (no real weights:
    the sizes are checked before any tensor is read)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    meta = {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16, "context_length": 64,
            "attention.head_count": 2, "attention.layer_norm_rms_epsilon": 1e-5} | overrides
    for key, value in meta.items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        if isinstance(value, int) and value >= 1 << 32:
            kind = gguf.GGUFValueType.UINT64
        w.add_key_value(f"llama.{key}", value, kind)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(65 + i) for i in range(10)])
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("key, value", [
    ("context_length", 1 << 28),
    ("context_length", 0),
    ("embedding_length", 1 << 40),
    ("block_count", 1 << 20),
    ("attention.head_count", 0),
    ("feed_forward_length", 2.5),
])
def test_gguf_sizes_out_of_range_are_refused_at_conversion(tmp_path, key, value):
    with pytest.raises(ModelError, match=f"llama.{key}={value!r} is out of range"):
        convert(tiny_gguf(tmp_path / "m.gguf", **{key: value}), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_manifest_claiming_a_2_28_context_is_refused(real_model_dir):
    """What serving sizes by the context (the KV budget, admission) never sees such a claim:
    a manifest made before this check, or sent by a peer, is refused when read."""
    config = Manifest.load(real_model_dir).config.to_dict()
    assert ModelConfig.from_dict(config | {"max_position": MAX_CONTEXT}).max_position == MAX_CONTEXT
    with pytest.raises(ModelError, match=f"max_position=268435456 must be an integer in 1..{MAX_CONTEXT}"):
        ModelConfig.from_dict(config | {"max_position": 1 << 28})
