"""Where a bench finds what it measures and what it measures against, on any machine where
``make test`` has run (never a path of the machine a bench was written on).

- Models: ``$MESHD_TEST_MODEL_DIR`` for the default model (the Makefile sets it), else
  ``models/NAME`` in ``$MESHD_STATE_DIR`` (the Makefile's state dir; the repo's ``state/``
  when unset, as the Makefile's default), else in meshd's own state dir, where
  ``meshd model fetch NAME`` puts it without ``--state-dir``.
- GGUF files: ``cache/`` of those state dirs, where the fetch keeps the files it converted.
- llama.cpp's tools: ``--llama-cpp DIR``, else ``$LLAMA_CPP_HOME``, else the folder that
  ``../shared/tools/llama-cpp`` (run from the repo root) prints: only once it has built
  (looked for where it builds), or when asked with ``--build-llama-cpp`` (10-15 minutes on
  2 cores, once per machine).

A reference that is not there is skipped with a line that says how to get it; the bench
goes on with the rest. Imports nothing heavy, so a bench's ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from meshd.config import default_state_dir  # noqa: E402 (the repo's own meshd, found through ROOT)

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-*.Q4_1.gguf"  # the default model's source, as the fetch keeps it
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
LLAMA_CPP_TOOL = ROOT.parent / "shared" / "tools" / "llama-cpp"
OUT = ROOT / "bench" / "out"  # plots and JSON figures


def state_dirs() -> list[Path]:
    """``$MESHD_STATE_DIR`` (else the repo's state/), then meshd's own state dir."""
    first = Path(os.environ.get("MESHD_STATE_DIR") or ROOT / "state")
    return list(dict.fromkeys([first, default_state_dir()]))


def state_dir() -> Path:
    """The state dir a bench writes to (converted models): where ``make test`` keeps its own."""
    return state_dirs()[0]


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Model ``name``'s directory: the first that holds it, else where ``make test`` puts it."""
    places = []
    if name == DEFAULT_MODEL and os.environ.get("MESHD_TEST_MODEL_DIR"):
        places.append(Path(os.environ["MESHD_TEST_MODEL_DIR"]))
    places += [d / "models" / name for d in state_dirs()]
    return next((p for p in places if (p / "manifest.json").is_file()), places[0])


def need_model(path: Path, name: str = DEFAULT_MODEL) -> Path:
    """``path`` if it holds a model, else the bench stops and says how to get one."""
    if not (Path(path) / "manifest.json").is_file():
        raise SystemExit(f"no model at {path}: `make test` fetches it, or `meshd model fetch {name} "
                         f"--state-dir {state_dir()}`; or pass --model DIR")
    return Path(path)


def gguf_file(pattern: str) -> Path | None:
    """The first GGUF file matching ``pattern`` in a state dir's cache/, or None."""
    for d in state_dirs():
        if found := sorted((d / "cache").glob(pattern)):
            return found[0]
    return None


# -- llama.cpp -----------------------------------------------------------------------------

HOW_TO_GET_LLAMA_CPP = ("build it once with ../shared/tools/llama-cpp (or add --build-llama-cpp), or pass "
                        "--llama-cpp DIR / set LLAMA_CPP_HOME to a folder with its bin/")


def add_llama_cpp_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-cpp", type=Path, metavar="DIR", default=None,
                    help="llama.cpp's folder (bin/llama-bench, bin/llama-server ...); default: $LLAMA_CPP_HOME, "
                         "else what ../shared/tools/llama-cpp prints once it has built")
    ap.add_argument("--build-llama-cpp", action="store_true",
                    help="build llama.cpp with ../shared/tools/llama-cpp if it is not built (10-15 min, once)")


def _tool_folder() -> Path:
    """Where ../shared/tools/llama-cpp builds (its own default, read from it), to tell that
    it has built without running it (a run that has not would start the build)."""
    if home := os.environ.get("LLAMA_CPP_HOME"):
        return Path(home)
    pkg = os.environ.get("LLAMA_CPP_PKG")
    if not pkg:
        found = re.search(r"LLAMA_CPP_PKG:-([^}]+)\}", LLAMA_CPP_TOOL.read_text())
        pkg = found.group(1) if found else ""
    return Path.home() / ".cache" / "meshd-tools" / f"llama.cpp-{pkg.rpartition('==')[2]}"


def llama_cpp(given: Path | None, build: bool = False, tools: tuple[str, ...] = ("llama-bench",)
              ) -> tuple[Path | None, str]:
    """(llama.cpp's folder, "") where its ``bin/`` has ``tools``, else (None, why and how to get it)."""
    def has(folder: Path) -> bool:
        return all((folder / "bin" / t).is_file() for t in tools)

    if given is not None:
        return (given, "") if has(given) else (None, f"--llama-cpp {given} has no bin/{' bin/'.join(tools)}")
    if (home := os.environ.get("LLAMA_CPP_HOME")) and has(Path(home)):
        return Path(home), ""
    if not LLAMA_CPP_TOOL.is_file():
        return None, ("llama.cpp not found (no ../shared/tools/llama-cpp beside this checkout): pass --llama-cpp DIR "
                      "or set LLAMA_CPP_HOME")
    if not build and not has(_tool_folder()):
        return None, f"llama.cpp is not built: {HOW_TO_GET_LLAMA_CPP}"
    done = subprocess.run([str(LLAMA_CPP_TOOL)], cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not has(Path(lines[-1])):
        return None, f"../shared/tools/llama-cpp gave no llama.cpp: {done.stderr.strip()[-300:]}"
    return Path(lines[-1]), ""


def add_model_flag(ap: argparse.ArgumentParser, name: str = DEFAULT_MODEL, what: str = "the model") -> None:
    ap.add_argument("--model", type=Path, default=model_dir(name),
                    help=f"{what}'s directory (default: %(default)s, where `make test` or "
                         f"`meshd model fetch {name}` put it)")


@contextlib.contextmanager
def one_node_daemon(model_dir: Path, work: Path, *flags: str) -> Iterator[str]:
    """A one-node ``meshd run`` of ``model_dir`` on a free loopback port (its state and log
    under ``work``, ``flags`` added), yielding its URL once it serves; stopped (SIGTERM,
    then SIGKILL after 30 s) when the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(work / "daemon.log", "wb")
    cmd = [sys.executable, "-m", "meshd.tools.cli", "run", "--no-mdns", "--host", "127.0.0.1", "--port", str(port),
           "--state-dir", str(work / "state"), "--model", str(model_dir), "--name", "bench", *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"meshd run did not serve; see {work / 'daemon.log'}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/healthz", timeout=2).status == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
