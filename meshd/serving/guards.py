"""What the HTTP side checks before it does any work for a caller: that a JSON body is
one a server can hold (not nested without end, no integers of thousands of digits),
that a control endpoint's caller is allowed (a key, this host, or a peer of the mesh)
and sent JSON (a foreign web page can POST text/plain to any address, but not
application/json without a preflight), that a control or Batch API call names this peer
in its ``Host`` (a DNS-rebinding page's requests name the attacker's host: its browser
treats them as same-origin, so no preflight and no CORS check stands in the way), that a prompt is not longer than the context
could ever hold before it is tokenized, and who the client is (for KV fairness).

Each is a small function or middleware, so the API's routes stay as they are.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable

import ifaddr
from aiohttp import web

from meshd.control.tunnel import CLIENT_HEADER
from meshd.errors import BadRequest
from meshd.serving.openai import error_json

MAX_JSON_DEPTH = 64
CLIENT_KEY = web.RequestKey("meshd_client", str)  # a request's client_id, for the proxy to forward
CONTROL_PREFIX = "/v1/mesh/"
# Paths whose Host is checked: control calls, and the Batch API (whose owner, on a peer
# without keys, is the client's address: a rebinding page on a user's box would be them).
HOST_CHECKED = (CONTROL_PREFIX, "/v1/files", "/v1/batches")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
JSON_TYPES = ("application/json",)


# -- bodies ----------------------------------------------------------------------------


def parse_json(raw: bytes, depth: int = MAX_JSON_DEPTH):
    """The JSON value of a request body, or BadRequest (400) saying what is wrong with it:
    not JSON, nested deeper than ``depth``, or a number past Python's digit limit."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"malformed JSON body: nested deeper than {depth} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if _depth_over(value, depth):
        raise BadRequest(f"malformed JSON body: nested deeper than {depth} levels")
    return value


def _depth_over(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False


def prompt_chars(body: object) -> int:
    """Characters of the text a completion or chat body has tokenized: its prompt, or its
    messages' contents (strings and text parts). Counted without tokenizing."""
    if not isinstance(body, dict):
        return 0
    total = 0
    prompt = body.get("prompt")
    for p in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(p, str):
            total += len(p)
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                total += len(part["text"])
    return total


def check_prompt_size(n: int, param: str, context: int, max_token_chars: int) -> None:
    """A prompt of ``n`` characters longer than ``context`` tokens of the longest token the
    vocabulary has cannot fit, whatever it tokenizes to: refused before the tokenizer sees
    it (a 1 MiB prompt took seconds of tokenizing)."""
    limit = context * max_token_chars
    if n > limit:
        raise BadRequest(f"the prompt has {n} characters; the context window of {context} tokens "
                         f"holds at most {limit}", param=param)


# -- callers ---------------------------------------------------------------------------


def local_caller(request: web.Request) -> bool:
    """A connection from this host: from loopback, or from one of this host's own
    addresses (its source is the address it reached)."""
    transport = request.transport
    if transport is None:
        return False
    peer, sock = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
    if not peer or not isinstance(peer, tuple):
        return isinstance(peer, str)  # a unix socket
    try:
        ip = ipaddress.ip_address(peer[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or (bool(sock) and ipaddress.ip_address(sock[0]) == ipaddress.ip_address(peer[0]))


FAIR_V6_PREFIX = 64  # one IPv6 client is its /64: a host may use any address in it (RFC 4941)


def fair_address(remote: str | None) -> str:
    """The address a client is counted under for its KV share: an IPv4 address as is (an
    IPv4-mapped IPv6 one as IPv4), an IPv6 address as its /64, since one host holds a whole
    /64 and could otherwise take a share per address."""
    try:
        ip = ipaddress.ip_address(remote or "")
    except ValueError:
        return remote or "?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, FAIR_V6_PREFIX), strict=False))
    return str(ip)


def client_id(request: web.Request, mesh_peer: bool, bearer: str | None) -> str:
    """Who a request is for, as KV admission counts it: the client a peer forwarded for,
    else the API key it used (hashed), else its address (an IPv6 one by its /64)."""
    if mesh_peer and (forwarded := request.headers.get(CLIENT_HEADER)):
        return forwarded[:128]
    if bearer:
        return "key:" + hashlib.sha256(bearer.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return "addr:" + fair_address(request.remote)


# -- Host (DNS rebinding) ------------------------------------------------------------------


@functools.cache
def machine_names() -> frozenset[str]:
    """This machine's own names: its hostname and its mDNS name (not the fully qualified
    name: finding that asks DNS, which may block the event loop for seconds)."""
    name = socket.gethostname().lower()
    return frozenset({name, name.split(".")[0] + ".local"}) if name else frozenset()


def machine_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of this machine's interfaces, as they are now (read per control call:
    they change, and control calls are rare)."""
    out = set()
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            addr = ip.ip[0] if isinstance(ip.ip, tuple) else ip.ip
            try:
                out.add(ipaddress.ip_address(addr.split("%")[0]))
            except ValueError:
                continue
    return out


def host_name(header: str) -> str:
    """The name or address in a ``Host`` header, without port or brackets, lower case."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(header: str | None, sockname, extra: Iterable[str]) -> bool:
    """Whether a request's ``Host`` names this peer: a loopback name or address, this
    machine's name, one of its addresses (or the one the connection reached), or a name
    the config allows (``allowed_hosts``: exact, ``.example.org`` for a domain and its
    subdomains, ``*`` for any). No ``Host`` at all (HTTP/1.0) is no browser's request."""
    if not header:
        return True
    host = host_name(header)
    extra = tuple(e.lower() for e in extra)
    if "*" in extra or host in extra or any(e.startswith(".") and (host.endswith(e) or host == e[1:])
                                            for e in extra):
        return True
    if host in LOOPBACK_NAMES or host.endswith(".localhost") or host in machine_names():
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    if sockname and isinstance(sockname, tuple):
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(sockname[0].split("%")[0]) == ip:
                return True
    return ip in machine_addresses()


def bearer_key(request: web.Request) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    value = request.headers.get("Authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def owner_of(request: web.Request, keyed: bool, bearer: str | None) -> str:
    """Who owns the files and batches a Batch API call makes: the API key (hashed) where
    keys are configured, else the client's address (as OpenAI keeps a project's apart)."""
    if keyed and bearer:
        return "key:" + hashlib.sha256(bearer.encode("utf-8", "surrogateescape")).hexdigest()
    return "addr:" + (request.remote or "?")


def control_guard(keys: Callable[[web.Request], Iterable[str]], mesh_peer: Callable[[web.Request], bool],
                  allowed_hosts: Iterable[str] = ()):
    """Middleware for ``/v1/mesh/*``: a ``Host`` that names this peer (also for the Batch
    API), JSON bodies only, and, when no key is configured for it, only callers on this
    host or peers of the mesh (with a key, the auth middleware asks for it)."""
    allowed_hosts = tuple(allowed_hosts)

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path.startswith(HOST_CHECKED) and not host_allowed(
                request.headers.get("Host"),
                request.transport.get_extra_info("sockname") if request.transport else None, allowed_hosts):
            return _error(f"Host {host_name(request.headers.get('Host', ''))[:100]!r} is not a name of this peer "
                          "(a defence against DNS rebinding); add it to allowed_hosts if it is one", 403,
                          param="Host")
        if request.path.startswith(CONTROL_PREFIX):
            if request.method not in ("GET", "HEAD", "OPTIONS") and request.content_type not in JSON_TYPES:
                return _error(f"control endpoints take application/json, not {request.content_type}", 415)
            if not any(True for _ in keys(request)) and not local_caller(request) and not mesh_peer(request):
                return _error("control endpoints answer callers on this host, peers of the mesh, or a "
                              "control key (control_key_file)", 403)
        return await handler(request)

    return guard


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    return web.json_response(error_json(message, status, param), status=status)
