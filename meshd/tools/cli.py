"""The ``meshd`` command: run a daemon, manage models, run a local demo mesh."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import structlog

from meshd.config import DEVICES, DTYPES, build_config
from meshd.errors import KNOWN_ERRORS, ConfigError
from meshd.logs import setup_logging

log = structlog.get_logger()

DEFAULT_CONFIG = Path("/etc/meshd/meshd.toml")


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, help="where models, the node id and the secret live")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="meshd", description="A peer-to-peer inference mesh for home labs.")
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", type=Path, help=f"TOML file (default {DEFAULT_CONFIG} if it exists)")
    run.add_argument("--name", help="this peer's name (default: the host name)")
    run.add_argument("--host", help="address to bind the API and peer links (default 0.0.0.0)")
    run.add_argument("--port", type=int, help="TCP port (default 8470)")
    run.add_argument("--mesh", help="mesh name; peers of other meshes are ignored")
    run.add_argument("--secret-file", type=Path, help="file holding the mesh secret")
    run.add_argument("--model", help="model name (in the state dir) or model directory")
    run.add_argument("--chat-template", metavar="NAME|FILE",
                     help="chat template over the model's own: chatml, llama3, gemma, mistral, phi3, qwen, or a "
                          "Jinja file (a model without one, and without ChatML tokens, refuses chat otherwise)")
    _add_state_dir(run)
    run.add_argument("--device", choices=DEVICES)
    run.add_argument("--dtype", choices=DTYPES)
    run.add_argument("--threads", type=int, help="torch threads (default: all cores; 1 per daemon when several share a box)")
    run.add_argument("--no-replicate", dest="replicate", action="store_const", const=False,
                     help="fetch only this peer's span, not the rest of the model in the background")
    run.add_argument("--mdns-interface", action="append", default=[], metavar="ADDR",
                     help="local address to run mDNS on (repeatable; default: real interfaces)")
    run.add_argument("--no-mdns", dest="mdns", action="store_const", const=False, help="no mDNS; static peers only")
    run.add_argument("--peer", action="append", default=[], metavar="HOST:PORT", help="static peer (repeatable)")
    run.add_argument("--cors-origin", dest="cors_origins", action="append", default=[], metavar="ORIGIN",
                     help="a browser origin allowed to call the API, or * for any (repeatable; default none)")
    run.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[], metavar="NAME",
                     help="a name control and Batch API calls may give in Host besides this machine's own "
                          "(repeatable; .example.org for a domain, * for any)")
    run.add_argument("--advertise-vram", type=int, metavar="BYTES", help="VRAM to advertise instead of the detected")
    run.add_argument("--mem-budget", type=int, metavar="BYTES", help="memory this peer offers for layers")
    run.add_argument("--prefix-cache-entries", type=int, metavar="N",
                     help="finished sessions whose KV stays for reuse by a request starting with the same tokens "
                          "(default 32; 0: off)")
    run.add_argument("--speculate", choices=("auto", "always", "off"),
                     help="speculative decoding: drafts from the session's own tokens, checked in the step "
                          "it runs anyway, the same tokens either way; auto (default): as many as pay on "
                          "this peer's measured step costs, always: every match in full, off")
    run.add_argument("--draft-model", metavar="NAME|DIR",
                     help="a small model with the served model's tokenizer that drafts tokens where lookup has "
                          "none (speculative decoding; loaded whole by the supernode; the same tokens either way)")
    run.add_argument("--heartbeat-s", type=float)
    run.add_argument("--missed-beats", type=int)
    run.add_argument("--batch-concurrency", type=int, help="batch-job lines this peer keeps in flight (default 32)")
    run.add_argument("--batch-max-bytes", type=int, metavar="BYTES",
                     help="size bound of the batch store in the state dir (default 1 GiB)")
    run.add_argument("--batch-takeover-s", type=float, metavar="S",
                     help="finish another peer's batch job from its replica here once that peer has been gone "
                          "this long (default 120)")
    run.add_argument("--log-level")
    run.add_argument("--api-key-file", type=Path, help="API keys, one per line (Bearer) for /v1")
    run.add_argument("--control-key-file", type=Path, help="keys for control endpoints (drain)")
    run.add_argument("--max-connections", type=int,
                     help="HTTP connections held at once; past it the oldest idle one is closed (default 1024)")
    run.add_argument("--http-idle-s", type=float, help="seconds an HTTP connection may idle or send its headers")
    run.add_argument("--tls-cert", type=Path, help="certificate: serve the API over HTTPS (peer links then use wss)")
    run.add_argument("--tls-key", type=Path)
    run.add_argument("--tls-ca", type=Path, help="CA that peers' HTTPS certificates must chain to")
    run.add_argument("--debug-plaintext-links", action="store_const", const=True,
                     help="DEBUGGING ONLY, every peer alike: send peer frames unencrypted (still authenticated)")
    run.add_argument("--debug-layer-delay-ms", type=float, help=argparse.SUPPRESS)
    run.add_argument("--debug-link-delay-ms", type=float, help=argparse.SUPPRESS)
    run.add_argument("--debug-link-jitter-ms", type=float, help=argparse.SUPPRESS)

    model = sub.add_parser("model", help="fetch, convert and list models")
    msub = model.add_subparsers(dest="model_command", required=True)
    fetch = msub.add_parser("fetch", help="obtain a known model (smollm2-135m, gemma3-270m)")
    fetch.add_argument("name")
    _add_state_dir(fetch)
    convert = msub.add_parser("convert", help="convert a GGUF file or a Hugging Face directory into shards")
    convert.add_argument("src", type=Path)
    convert.add_argument("--out", type=Path, required=True)
    convert.add_argument("--dtype", default=None, choices=[d for d in DTYPES if d != "auto"],
                         help="expand to this float type (default: a GGUF keeps its own quantization, "
                              "a Hugging Face directory is float32)")
    convert.add_argument("--name", help="model name (default: from the source)")
    convert.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantized layers")
    convert.add_argument("--quantize-head", nargs="?", const=True, default=False, choices=["int8", "int4"],
                         help="quantize the head (and a tied embedding) too; bare: the --quantize kind")
    convert.add_argument("--group-size", type=int, default=32, help="int4 group size (32, 64, 128, 256)")
    lst = msub.add_parser("list", help="models in the state dir")
    _add_state_dir(lst)

    demo = sub.add_parser("demo", help="a local mesh of N daemons on 127.0.0.1, one completion, then status")
    demo.add_argument("--peers", type=int, default=3)
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--prompt", default="The capital of France is")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--base-port", type=int, default=0, help="first port (default: free ports)")
    _add_state_dir(demo)

    cfg = sub.add_parser("config", help="configuration")
    csub = cfg.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the effective configuration (no secret)")
    show.add_argument("--config", type=Path)

    svc = sub.add_parser("install-service", help="install the systemd unit, /etc/meshd/meshd.toml and a secret")
    svc.add_argument("--root", type=Path, default=Path("/"), help="install under this directory (default /)")
    svc.add_argument("--exec", dest="exec_path", help="meshd command for ExecStart (default: this one)")
    svc.add_argument("--enable", action="store_true", help="then systemctl enable --now meshd")
    return top


def _config_file(arg: Path | None) -> Path | None:
    if arg is not None:
        return arg
    if env := os.environ.get("MESHD_CONFIG"):
        return Path(env)
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def _flags(args: argparse.Namespace) -> dict:
    skip = {"command", "config"}
    out = {k: v for k, v in vars(args).items() if k not in skip}
    out["mdns_interface"] = tuple(out.pop("mdns_interface", []) or ())
    out["peer"] = tuple(out.get("peer") or ())
    if not out.get("cors_origins"):
        out.pop("cors_origins", None)  # unset: the config file or environment decides
    else:
        out["cors_origins"] = tuple(out["cors_origins"])
    if not out.get("allowed_hosts"):
        out.pop("allowed_hosts", None)
    else:
        out["allowed_hosts"] = tuple(out["allowed_hosts"])
    return out


def _state_dir(args: argparse.Namespace) -> Path:
    return build_config(flags={"state_dir": args.state_dir}).state_dir


def cmd_run(args: argparse.Namespace) -> int:
    config = build_config(_config_file(args.config), flags=_flags(args))
    setup_logging(config.log_level)
    import torch

    from meshd.node import Node
    from meshd.tools.notify import Notifier

    node = Node(config)
    # Torch work belongs to the engines' workers (shards/engine.py default_threads), each
    # made with the node's count: this thread (the event loop's) runs on one, so it never
    # keeps an OpenMP pool of its own.
    torch.set_num_threads(1)
    notifier = Notifier.from_env()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(sig: int) -> None:
            nonlocal signals
            signals += 1
            if signals > 1:
                log.warning("forced_exit", signal=signal.Signals(sig).name)
                os._exit(130)
            log.info("signal_received", signal=signal.Signals(sig).name)
            notifier.stopping()
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await node.run(stop, on_ready=notifier.ready, watchdog=notifier.watchdog)

    asyncio.run(main())
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    setup_logging()
    from shards.convert import convert
    from shards.fetch import fetch_default, list_models

    if args.model_command == "fetch":
        path = fetch_default(_state_dir(args), args.name)
        print(path)
    elif args.model_command == "convert":
        path = convert(args.src, args.out, dtype=args.dtype, name=args.name, quantize=args.quantize,
                       quantize_head=args.quantize_head, group_size=args.group_size)
        print(path)
    else:
        for m in list_models(_state_dir(args)):
            print(f"{m.name}\t{m.n_layers} layers\t{m.dtype}\t{sum(e.size for e in m.files.values())} bytes")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import json

    config = build_config(_config_file(args.config))
    shown = config.redacted()
    shown["secret"] = f"<{'set' if config.secret_path.exists() else 'unset'}, in {config.secret_path}>"
    print(json.dumps(shown, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        match args.command:
            case "run":
                return cmd_run(args)
            case "model":
                return cmd_model(args)
            case "demo":
                from meshd.tools.demo import run_demo

                setup_logging()
                return run_demo(args)
            case "config":
                return cmd_config(args)
            case "install-service":
                from meshd.tools.service import install

                install(args.root, args.exec_path, args.enable)
                return 0
    except ConfigError as exc:
        print(f"meshd: configuration error: {exc}", file=sys.stderr)
        return 2
    except KNOWN_ERRORS as exc:
        print(f"meshd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
