"""Chat with a model that ships no chat template (issue 35), on the real Gemma 3 270M base
model (its GGUF has no ``tokenizer.chat_template``): a chat is a 400 that names
``--chat-template`` rather than ChatML its vocabulary has no tokens for; with
``--chat-template gemma`` (or a file) the prompt is Gemma's turn format, token for token
what transformers' ``apply_chat_template`` makes with Gemma 3's own template, and the model
answers; on a mesh the supernode's template is the one that counts, a member's once it
leads. SmolLM2, which ships its own template, renders as before, and a template-less model
whose vocabulary has ChatML's markers still falls back to ChatML.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from meshd.config import build_config
from meshd.errors import ConfigError, ModelError
from meshd.node import chat_template_of
from shards.chat import ChatTemplate
from shards.chat_templates import BUILTIN, given_template
from shards.manifest import Manifest
from shards.tokenizer import MeshTokenizer
from tests.fixtures.daemon import linked_pair, running_node
from tests.inproc import until

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

# Gemma 3's chat template as google/gemma-3-270m-it (and every Gemma 3 -it model) ships it in
# tokenizer_config.json: the independent reference the renders below are checked against.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

ASK = [{"role": "user", "content": "Name three colors."}]
CHATS = {
    "one turn": ASK,
    "system and turns": [{"role": "system", "content": "Answer in one word."},
                         {"role": "user", "content": "  The sky's colour?  "},
                         {"role": "assistant", "content": "Blue."},
                         {"role": "user", "content": "And grass?"}],
}
OUT_OF_TURN = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> Path:
    """The real Gemma 3 270M as ``make test`` fetches it (``meshd model fetch gemma3-270m``:
    a check only once fetched)."""
    state = Path(os.environ.get("MESHD_STATE_DIR") or Path.home() / ".cache" / "meshd-test")
    done = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "model", "fetch", "gemma3-270m", "--state-dir",
                           str(state)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert Manifest.load(path).chat_template is None  # the base model: no template of its own
    return path


@pytest.fixture(scope="module")
def reference(gemma_dir):
    """transformers' tokenizer on Gemma's vocabulary with Gemma 3's own template (offline:
    built from the tokenizer.json, nothing from the hub)."""
    tok = Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", unk_token="<unk>", chat_template=GEMMA3_TEMPLATE)


def want_ids(reference, chat) -> list[int]:
    return list(reference.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])


async def get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def post_json(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as resp:
        assert resp.content_type == "application/json", await resp.text()
        return resp.status, await resp.json()


async def chat_fields(http: aiohttp.ClientSession, url: str, model: str) -> tuple:
    """(chat, chat_template) as GET /v1/models/{id} and GET /v1/models say them (the same)."""
    one = await get_json(http, f"{url}/v1/models/{model}")
    listed = (await get_json(http, url + "/v1/models"))["data"][0]
    assert (one["chat"], one["chat_template"]) == (listed["chat"], listed["chat_template"])
    return one["chat"], one["chat_template"]


def assert_refused(status: int, data: dict) -> None:
    assert status == 400, data
    err = data["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "chat_template_missing", err
    assert "--chat-template" in err["message"] and "no chat template" in err["message"], err


async def assert_renders_as_gemma(http, url: str, reference) -> None:
    """The supernode's prompt for each chat is transformers' with Gemma 3's template."""
    for label, chat in CHATS.items():
        status, data = await post_json(http, url + "/tokenize", {"messages": chat})
        assert status == 200, data
        want = want_ids(reference, chat)
        assert data["tokens"] == want, label
        text = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
        assert reference.decode(data["tokens"]) == text, label
    status, data = await post_json(http, url + "/v1/chat/completions", {"messages": OUT_OF_TURN})
    assert status == 400 and "must alternate" in data["error"]["message"], data  # the template's own refusal


async def assert_answers(http, url: str, reference) -> None:
    status, data = await post_json(http, url + "/v1/chat/completions",
                                   {"messages": ASK, "max_tokens": 12, "temperature": 0})
    assert status == 200, data
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length"), choice
    assert data["usage"]["prompt_tokens"] == len(want_ids(reference, ASK))
    assert data["usage"]["completion_tokens"] >= 1
    assert "<start_of_turn>" not in choice["message"]["content"] and "<|im_start|>" not in choice["message"]["content"]


# -- the templates by name, and the choice among them ------------------------------------


def test_builtin_templates_are_the_models_own(llama_cpp_src):
    """gemma is Gemma 3's; phi3 and qwen are, to the byte, the copies llama.cpp keeps of
    Phi-3.5-mini-instruct's and Qwen2.5-7B-Instruct's."""
    assert BUILTIN["gemma"] == GEMMA3_TEMPLATE
    kept = llama_cpp_src / "models" / "templates"
    assert BUILTIN["phi3"] == (kept / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    assert BUILTIN["qwen"] == (kept / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    assert set(BUILTIN) == {"chatml", "llama3", "gemma", "mistral", "phi3", "qwen"}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_each_builtin_renders_as_transformers_renders_it(name, real_model_dir):
    tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=BUILTIN[name], **specials)
    ours = ChatTemplate(BUILTIN[name], specials, name)
    chats = [ASK, CHATS["system and turns"][1:]]
    if name not in ("mistral",):  # Mistral's template takes a system message only first, then alternation
        chats.append(CHATS["system and turns"])
    for chat in chats:
        for gen in (True, False):
            assert ours.render(chat, add_generation_prompt=gen) == ref.apply_chat_template(
                chat, add_generation_prompt=gen, tokenize=False), (name, chat, gen)


def test_the_choice_of_template(real_model_dir, gemma_dir, tmp_path):
    """Given over the model's own; the model's own; ChatML only where the vocabulary has its
    markers; else none, and a render says so."""
    smol = MeshTokenizer.load(real_model_dir)
    assert (smol.template.origin, smol.template.source) == ("model", Manifest.load(real_model_dir).chat_template)
    over = MeshTokenizer.load(real_model_dir, given_template("chatml"))
    assert over.template.origin == "chatml" and "SmolLM" not in over.render_chat(ASK)
    bare = MeshTokenizer(smol.tokenizer, None, smol.eos_ids, smol.bos_id, smol.special_tokens)
    assert bare.template.origin == "chatml-fallback"
    # What the hand-written ChatML fallback wrote before the built-in replaced it:
    assert bare.render_chat(ASK) == "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
    gemma = MeshTokenizer.load(gemma_dir)
    assert not gemma.template.available and gemma.template.origin is None
    with pytest.raises(ModelError, match="no chat template"):
        gemma.render_chat(ASK)
    path = tmp_path / "mine.jinja"
    path.write_text(GEMMA3_TEMPLATE)
    assert given_template(str(path)).origin == "file:mine.jinja"
    odd = tmp_path / "my template\n.jinja"  # the origin is a label in the Plan: never more than one
    odd.write_text(GEMMA3_TEMPLATE)
    assert given_template(str(odd)).origin == "file:my_template_.jinja"


def test_smollm2_renders_as_before(real_model_dir):
    """SmolLM2 ships ChatML with a default system turn: its chats render as transformers
    renders them with that template, byte for byte and token for token."""
    tok = MeshTokenizer.load(real_model_dir)
    manifest = Manifest.load(real_model_dir)
    vocab = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, chat_template=manifest.chat_template,
                                               **manifest.special_tokens)
    assert tok.render_chat(ASK) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                    "Hugging Face<|im_end|>\n<|im_start|>user\nName three colors.<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    for chat in CHATS.values():
        assert tok.render_chat(chat) == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tok.encode_chat(chat) == list(ref.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])


def test_a_bad_chat_template_stops_the_daemon_at_start(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content ")
    for value, match in (("gemma4", "neither a built-in template"), (str(tmp_path / "absent.jinja"), "nor a file"),
                         (str(broken), "does not compile")):
        with pytest.raises(ConfigError, match=match):
            chat_template_of(build_config(environ={"MESHD_CHAT_TEMPLATE": value}))
    assert chat_template_of(build_config(flags={"chat_template": "qwen"})).origin == "qwen"
    (tmp_path / "meshd.toml").write_text('chat_template = "phi3"\n')
    assert build_config(tmp_path / "meshd.toml", environ={}).chat_template == "phi3"
    done = subprocess.run([sys.executable, "-m", "meshd.tools.cli", "run", "--no-mdns", "--host", "127.0.0.1",
                           "--port", "1", "--state-dir", str(tmp_path / "s"), "--chat-template", "gemma4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "gemma4" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


# -- the real Gemma 3 on a node, and on a mesh --------------------------------------------


async def test_on_a_mesh_the_supernodes_template_file_serves_every_peer(gemma_dir, reference, tmp_path):
    """The supernode renders: its --chat-template (here a file) serves a chat sent to any
    peer, and every peer's /v1/models says so (a member learns it from the plan)."""
    (tmp_path / "gemma3.jinja").write_text(GEMMA3_TEMPLATE)
    async with linked_pair(gemma_dir, tmp_path, chat_template=str(tmp_path / "gemma3.jinja")) as (sup, entry), \
            aiohttp.ClientSession() as http:
        assert not entry.node.view.is_supernode and entry.node.config.chat_template is None
        for peer in (sup, entry):
            assert await chat_fields(http, peer.url, sup.node.model_name) == (True, "file:gemma3.jinja")
        await assert_renders_as_gemma(http, sup.url, reference)
        await assert_answers(http, entry.url, reference)


async def test_without_a_template_chat_is_refused_until_a_peer_with_one_leads(gemma_dir, reference, tmp_path):
    """No template on the supernode: a chat is a 400 naming --chat-template from any peer,
    streamed or not, whatever a member's own flag says, and completions are untouched. Once
    that member leads (the supernode stops), its --chat-template gemma is the one that counts."""
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    async with running_node(gemma_dir, tmp_path / "sup", name="sup", advertise_vram=8 << 30,
                            secret_file=secret) as sup:
        port = sup.url.rsplit(":", 1)[1]
        async with running_node(gemma_dir, tmp_path / "entry", name="entry", advertise_vram=4 << 30,
                                secret_file=secret, peer=(f"127.0.0.1:{port}",), chat_template="gemma") as entry, \
                aiohttp.ClientSession() as http:
            await until(lambda: entry.node.uplink.serves() and not entry.node.view.is_supernode, timeout=60)
            model = sup.node.model_name
            for peer in (sup, entry):
                assert await chat_fields(http, peer.url, model) == (False, None)
                for stream in (False, True):
                    assert_refused(*await post_json(http, peer.url + "/v1/chat/completions",
                                                    {"messages": ASK, "stream": stream}))
            status, data = await post_json(http, entry.url + "/v1/completions",
                                           {"prompt": "Red, green and", "max_tokens": 4, "temperature": 0})
            assert status == 200 and data["usage"]["completion_tokens"] >= 1, data

            sup.stop.set()  # a graceful stop: the member takes over, with its own template
            await asyncio.wait_for(sup.task, 60)
            await until(lambda: entry.node.view.is_supernode and entry.node.uplink.serves(), timeout=300)
            assert await chat_fields(http, entry.url, model) == (True, "gemma")
            await assert_renders_as_gemma(http, entry.url, reference)
            await assert_answers(http, entry.url, reference)
