"""``meshctl``: look at and steer a mesh through any peer's HTTP API.

Exit codes, the same for every command, so a script can branch on them:

- 0: done (``status``: the mesh serves; ``plan``: a plan is active)
- 1: the peer answered but said no (not serving, no plan, drain refused, generation failed,
  a batch failed or has failed lines)
- 2: no answer from the peer
- 64: bad usage (unknown command or option)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from meshd.tools import batchctl, observe
from meshd.tools.client import Unreachable, auth_headers, base_url, render_table

DEFAULT_URL = "http://127.0.0.1:8470"
EXIT_SERVING, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE = 0, 1, 2, 64
EXIT_OK, EXIT_REFUSED = EXIT_SERVING, EXIT_NOT_SERVING
PEER_STATUS_TIMEOUT_S = 2.0


def get_json(url: str, timeout: float = 5.0) -> dict:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # a 503 still carries the JSON body
        return json.loads(exc.read())


def post_json(url: str, body: dict, timeout: float, key: str | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"} | auth_headers(key)
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"error": {"message": raw.decode(errors="replace")[:300]}}


def fetch_status(base: str) -> dict:
    try:
        return get_json(base + "/status")
    except (OSError, ValueError) as exc:
        raise Unreachable(f"no answer from {base}: {exc}") from None


def human_bytes(n: int | None) -> str:
    if not n:
        return "-"
    size: float = n  # in ``unit``s
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def used_of(used: int | None, total: int | None) -> str:
    """'412.0 MiB/15.6 GiB'; the total alone when the use is unknown; '-' for none."""
    if not total:
        return "-"
    return f"{human_bytes(used)}/{human_bytes(total)}" if used else human_bytes(total)


def _rate(node: dict | None, role: str) -> str:
    """Tokens generated per second on the supernode, token positions through the span on a stage."""
    if not node:
        return "-"
    rate = node.get("tokens_per_s") if role == "supernode" else node.get("forward_tokens_per_s")
    return "-" if rate is None else f"{rate:.1f}"


def format_status(status: dict, details: dict[str, dict] | None = None) -> str:
    """The status table. Each peer's RAM in use is in ``status`` (peers report it); ``details``
    maps peer id to that peer's own /status ``node`` section (VRAM in use, tokens/s, and RAM
    from a peer too old to report it); this peer's own row always has it."""
    details = dict(details or {})
    if status.get("node"):
        details.setdefault(status["node"]["id"], status["node"])
    head = (f"mesh model {status.get('model')}  term {status.get('term')}  "
            f"supernode {status.get('supernode') or '-'}  "
            f"{'serving' if status.get('serving') else 'NOT serving: ' + str(status.get('reason'))}")
    rows = [["PEER", "NAME", "ADDR", "ROLE", "DEVICE", "VRAM", "RAM", "LAYERS", "STATE", "RTT", "TOK/S"]]
    for p in status.get("peers", []):
        layers = p.get("layers")
        rtt = p.get("rtt_ms")
        mine = details.get(p["id"]) if p.get("state") != "lost" else None
        memory = (mine or {}).get("memory") or {}
        rows.append([
            p["id"] + (" *" if p.get("self") else ""), p.get("name") or "-", p.get("addr") or "-", p["role"],
            p.get("device") or "-", used_of(memory.get("vram_used"), p.get("vram")),
            used_of(p.get("ram_used") or memory.get("rss"), p.get("ram")),
            f"{layers[0]}-{layers[1]}" if layers else "-", p["state"],
            "-" if rtt is None else f"{rtt:.2f} ms", _rate(mine, p["role"]),
        ])
    plan = " ".join(f"{a['node']}[{a['start']}:{a['stop']})" for a in status.get("plan", [])) or "none"
    spec = ((details.get(status.get("supernode") or "") or {}).get("scheduler") or {}).get("speculation")
    if spec:  # the supernode's drafts (prompt lookup, a draft model), where meshctl could read them
        plan += (f"\nspeculation {spec['drafted']} drafted, {spec['accepted']} taken"
                 + (f" ({spec['acceptance']:.0%}), {spec['tokens_per_step']:.2f} tokens per checked step"
                    if spec.get("steps") else "")
                 + (f"; draft model {spec['draft_model']}: {spec.get('model_drafted', 0)} drafted, "
                    f"{spec.get('model_accepted', 0)} taken" if spec.get("draft_model") else ""))
    terms = "\n".join(f"  term {t['term']}: {t.get('reason') or '-'}" for t in status.get("terms", [])[-5:])
    return f"{head}\nplan {plan}\n\n{render_table(rows)}" + (f"\n\nterms\n{terms}" if terms else "")


def peer_details(status: dict) -> dict[str, dict]:
    """Each live peer's own /status ``node`` section, asked of it directly (in parallel,
    briefly); a peer this machine cannot reach just shows less."""
    targets = [p for p in status.get("peers", []) if not p.get("self") and p.get("state") != "lost" and p.get("addr")]

    def one(p: dict) -> tuple[str, dict | None]:
        try:
            return p["id"], get_json(f"http://{p['addr']}/status", timeout=PEER_STATUS_TIMEOUT_S).get("node")
        except (OSError, ValueError):
            return p["id"], None

    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(targets))) as pool:
        return {pid: node for pid, node in pool.map(one, targets) if node and node.get("id") == pid}


# -- commands ---------------------------------------------------------------------------


def _status_once(args: argparse.Namespace) -> int:
    status = fetch_status(base_url(args))
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status, peer_details(status)))
    return EXIT_SERVING if status.get("serving") else EXIT_NOT_SERVING


def cmd_status(args: argparse.Namespace) -> int:
    if args.watch is None:
        return _status_once(args)
    tty = sys.stdout.isatty()
    code = EXIT_UNREACHABLE
    try:
        for i in range(args.count or sys.maxsize):
            if i:
                time.sleep(args.watch)
            if tty:
                print("\033[H\033[2J", end="")
            elif i:
                print()
            print(time.strftime("%H:%M:%S"), f"(every {args.watch:g} s, Ctrl-C to stop)")
            try:
                code = _status_once(args)
            except Unreachable as exc:  # keep watching: the daemon may be restarting
                print(f"meshctl: {exc}")
                code = EXIT_UNREACHABLE
            sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    return code


def cmd_plan(args: argparse.Namespace) -> int:
    status = fetch_status(base_url(args))
    shown = {k: status.get(k) for k in ("term", "supernode", "model", "serving", "plan", "terms")}
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        names = {p["id"]: p.get("name") or "-" for p in status.get("peers", [])}
        print(f"term {status.get('term')}  supernode {status.get('supernode') or '-'}  model {status.get('model')}")
        if status.get("plan"):
            rows = [["NODE", "NAME", "LAYERS", "COUNT"]]
            for a in status["plan"]:
                rows.append([a["node"], names.get(a["node"], "-"), f"[{a['start']}:{a['stop']})",
                             str(a["stop"] - a["start"])])
            print(render_table(rows))
        else:
            print(f"no active plan: {status.get('reason') or '-'}")
        if status.get("terms"):
            print("\nterms")
            for t in status["terms"][-10:]:
                spans = " ".join(f"{a['node']}[{a['start']}:{a['stop']})" for a in t.get("plan", []))
                print(f"  term {t['term']}: {t.get('reason') or '-'}" + (f"  {spans}" if spans else ""))
    return EXIT_OK if status.get("plan") else EXIT_REFUSED


def cmd_peers(args: argparse.Namespace) -> int:
    status = fetch_status(base_url(args))
    peers = status.get("peers", [])
    if args.json:
        print(json.dumps(peers, indent=2))
        return EXIT_OK
    rows = [["PEER", "NAME", "ADDR", "STATE", "ROLE", "DEVICE", "RTT", "NOTE"]]
    for p in peers:
        rtt = p.get("rtt_ms")
        note = p.get("lost_reason") or ("this peer" if p.get("self") else "")
        rows.append([p["id"], p.get("name") or "-", p.get("addr") or "-", p["state"], p["role"],
                     p.get("device") or "-", "-" if rtt is None else f"{rtt:.2f} ms", note])
    print(render_table(rows))
    return EXIT_OK


def resolve_peer(status: dict, name: str) -> str:
    """A node id from an id or a peer name (as shown by ``meshctl peers``)."""
    peers = status.get("peers", [])
    if any(p["id"] == name for p in peers):
        return name
    by_name = [p["id"] for p in peers if p.get("name") == name and p.get("state") != "lost"]
    if len(by_name) == 1:
        return by_name[0]
    if len(by_name) > 1:
        raise ValueError(f"{len(by_name)} peers are named {name!r}; give the id ({', '.join(by_name)})")
    return name  # let the supernode say it does not know it


def cmd_drain(args: argparse.Namespace) -> int:
    base = base_url(args)
    try:
        node = resolve_peer(fetch_status(base), args.node)
    except ValueError as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        code, body = post_json(base + "/v1/mesh/drain", {"node": node}, timeout=args.timeout, key=args.api_key)
    except (OSError, ValueError) as exc:
        raise Unreachable(f"no answer from {base}: {exc}") from None
    if code != 200:
        message = (body.get("error") or {}).get("message") or json.dumps(body)
        print(f"meshctl: drain {node} refused (HTTP {code}): {message}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        spans = " ".join(f"{a['node']}[{a['start']}:{a['stop']})" for a in body.get("plan", []))
        print(f"drained {node}: term {body.get('term')}, plan {spans or 'none'}")
    return EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream a completion to the terminal as its tokens arrive."""
    base = base_url(args)
    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.chat:
        body["messages"] = [{"role": "user", "content": args.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = args.prompt
        path = "/v1/completions"
    headers = {"Content-Type": "application/json"} | auth_headers(args.api_key)
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        resp = urllib.request.urlopen(req, timeout=args.timeout)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        print(f"meshctl: generation refused (HTTP {exc.code}): {message}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        raise Unreachable(f"no answer from {base}: {exc}") from None
    out = sys.stdout
    wrote_any = False
    with resp:
        for raw in resp:  # one SSE line at a time, as the server sends them
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators and ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                if wrote_any:
                    out.write("\n")
                out.flush()
                return EXIT_OK
            event = json.loads(data)
            if event.get("error"):
                out.write("\n" if wrote_any else "")
                out.flush()
                print(f"meshctl: generation failed: {event['error'].get('message')}", file=sys.stderr)
                return EXIT_REFUSED
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if args.chat else choice.get("text")
                if piece:
                    out.write(piece)
                    out.flush()
                    wrote_any = True
    print("\nmeshctl: the stream ended without [DONE]", file=sys.stderr)
    return EXIT_REFUSED


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 64 (EX_USAGE), so that 2 keeps meaning 'no answer'."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="meshctl", description="Look at and steer a meshd mesh through any peer.",
                  epilog="exit codes: 0 done/serving, 1 answered but no (not serving, refused, failed), "
                         "2 no answer, 64 bad usage")
    top.add_argument("--url", default=DEFAULT_URL, help=f"any peer's API (default {DEFAULT_URL})")
    top.add_argument("--api-key", default=os.environ.get("MESHCTL_API_KEY"),
                     help="Bearer key for generate (a control key for drain); default $MESHCTL_API_KEY")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--url", default=argparse.SUPPRESS, help="any peer's API")
        if json_flag:
            p.add_argument("--json", action="store_true", help="raw JSON")
        return p

    status = command("status", "the mesh as this peer sees it: a table of peers (exit 0 when it serves)")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    status.add_argument("--count", type=int, help="with --watch: stop after this many refreshes")
    command("plan", "the active plan (who holds which layers) and the term history")
    command("peers", "every peer this one knows, with its state and round trip")
    drain = command("drain", "move a peer's layers to the others, before stopping it")
    drain.add_argument("node", help="node id or peer name")
    drain.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the new plan")
    gen = command("generate", "stream a completion to the terminal", json_flag=False)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--chat", action="store_true", help="as a chat message (the model's chat template)")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each token")
    observe.add_parsers(sub, command)
    batchctl.add_parser(sub, _Parser)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {"status": cmd_status, "plan": cmd_plan, "peers": cmd_peers, "drain": cmd_drain,
                "generate": cmd_generate, "batch": batchctl.run, "trace": observe.cmd_trace, "top": observe.cmd_top}
    try:
        return commands[args.command](args)
    except Unreachable as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokenPipeError:  # `meshctl status | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
