"""Nothing that runs only on the machine it was written on (issue 35): no absolute path of
a home, checkout or temporary directory in the source, and every bench starts (``--help``)
with defaults that are where ``make test`` puts things (bench/locate.py), or says how to
get a reference it lacks instead of failing."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("bench", "meshd", "shards", "protocol", "tests")
TEXT_SOURCES = {".c", ".h", ".html", ".js", ".css", ".sh", ".toml"}
# A home, a checkout or a temporary directory, as the start of an absolute path (not a
# part of a longer one, a URL's path, or ~/...).
MACHINE_PATH = re.compile(r"(?<![\w.~$/-])/(?:root|home|work|tmp)(?:/|\b)")
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))
HELP_TIMEOUT_S = 180  # Python + torch imported on two busy cores
DEFAULT_PATH = re.compile(r"\(default: (/[^\s,)]+)")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def machine_paths(path: Path) -> list[str]:
    """Where ``path`` names a machine's own directory in what it runs: string literals of
    Python (a docstring or a comment may show an example path), anything in other sources."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return [f"{path}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                if MACHINE_PATH.search(line)]
    tree = ast.parse(text, str(path))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # an f-string: what it puts in front of a piece counts
            skip.update(id(v) for v in node.values)
            value = "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            value = node.value
        else:
            continue
        if MACHINE_PATH.search(value):
            found.append(f"{path}:{node.lineno}: {value!r}")
    return found


def test_the_rule_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    sample = ('"""Example: MESHD_STATE_DIR=@tmp@kt bench@x.py"""\n'
              '# built in @root@.cache once\n'
              'A = "@root@.cache@meshd-tools@llama.cpp-1@bin"\n'
              'B = f"{X}@work@cache"  # a part of a longer path: fine\n'
              'C = "@work@cache@gemma@x.gguf"\n'
              'D = "http:@@127.0.0.1:8470@home"\n'
              'E = "~@.cache@meshd-test"\n'
              'F = "@tmp"\n')
    bad.write_text(sample.replace("@", "/"))  # (spelled so that this file holds none of them)
    found = machine_paths(bad)
    assert [f.split(":")[1] for f in found] == ["3", "5", "8"], found


def test_no_source_file_names_a_path_of_one_machine():
    found = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and (path.suffix == ".py" or path.suffix in TEXT_SOURCES):
                found += machine_paths(path)
    assert not found, "absolute paths of one machine:\n" + "\n".join(found)


def _state_dir() -> Path:
    """The state dir ``make test`` uses: the Makefile's (MESHD_STATE_DIR), else the repo's state/."""
    return Path(os.environ.get("MESHD_STATE_DIR") or ROOT / "state")


def _help(bench: str, env: dict[str, str]) -> tuple[str, subprocess.CompletedProcess]:
    return bench, subprocess.run([sys.executable, str(ROOT / "bench" / bench), "--help"], capture_output=True,
                                 text=True, timeout=HELP_TIMEOUT_S, env=env, cwd=ROOT / "bench")


def test_every_bench_starts_and_finds_its_defaults_where_make_test_puts_them():
    """Each bench's --help runs (from another folder than the repo root) and each default path
    it shows is in the state dir `make test` fills (or the repo: bench/out); the models and
    GGUF files there exist once `make test` has run."""
    state = _state_dir()
    if not (state / "models" / "smollm2-135m" / "manifest.json").is_file():
        pytest.skip(f"no `make test` state dir at {state}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHD_", "LLAMA_CPP"))} | {
        "MESHD_STATE_DIR": str(state), "MESHD_TEST_MODEL_DIR": str(state / "models" / "smollm2-135m"),
        "PYTHONPATH": str(ROOT), "COLUMNS": "1000"}  # (argparse would break a long path across lines)
    assert len(BENCHES) >= 15, BENCHES
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = list(pool.map(lambda b: _help(b, env), BENCHES))
    shown = {}
    for bench, out in done:
        assert out.returncode == 0 and out.stdout.startswith("usage:"), (bench, out.stderr[-2000:])
        text = " ".join(out.stdout.split())
        shown[bench] = DEFAULT_PATH.findall(text)
        for default in shown[bench]:
            path = Path(default)
            assert path.is_relative_to(state) or path.is_relative_to(ROOT), (bench, default)
            if path.is_relative_to(state):
                assert path.exists(), (bench, default)
    # The benches of the real model, and the Gemma GGUF, all show where they found them.
    model = str(state / "models" / "smollm2-135m")
    for bench in ("bench_batch.py", "bench_mesh.py", "bench_pipeline.py", "bench_single.py", "bench_quant.py",
                  "bench_grammar.py", "bench_throughput.py", "bench_transport.py", "bench_failover.py"):
        assert model in shown[bench], (bench, shown[bench])
    assert str(state / "cache" / "gemma-3-270m-q4_k_m.gguf") in shown["bench_gguf.py"]
    assert any(p.endswith(".Q4_1.gguf") for p in shown["bench_pipeline.py"])


def _locate():
    spec = importlib.util.spec_from_file_location("bench_locate", ROOT / "bench" / "locate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_missing_llama_cpp_is_a_skip_that_says_how_to_get_it(tmp_path, monkeypatch):
    """No llama.cpp (nothing given, none built, no build asked): no folder, a reason that
    names the ways to get one, and no build started. One given is used as it is."""
    locate = _locate()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the tool would have built: nothing
    monkeypatch.setenv("LLAMA_CPP_HOME", str(tmp_path / "empty"))
    folder, why = locate.llama_cpp(None)
    assert folder is None and "--llama-cpp DIR" in why and "LLAMA_CPP_HOME" in why, why
    assert not (tmp_path / "empty").exists()  # the tool never ran (it would have made its folder)
    folder, why = locate.llama_cpp(tmp_path / "nothing-here")
    assert folder is None and "has no bin/llama-bench" in why
    built = tmp_path / "llama.cpp"
    (built / "bin").mkdir(parents=True)
    (built / "bin" / "llama-bench").write_text("")
    assert locate.llama_cpp(built) == (built, "")
    monkeypatch.setenv("LLAMA_CPP_HOME", str(built))
    assert locate.llama_cpp(None) == (built, "")


def test_models_are_found_where_make_test_or_meshd_model_fetch_put_them(tmp_path, monkeypatch):
    locate = _locate()
    monkeypatch.delenv("MESHD_TEST_MODEL_DIR", raising=False)
    monkeypatch.setenv("MESHD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert locate.model_dir("gemma3-270m") == tmp_path / "state" / "models" / "gemma3-270m"  # nowhere yet
    fetched = tmp_path / "xdg" / "meshd" / "models" / "gemma3-270m"  # `meshd model fetch` without --state-dir
    fetched.mkdir(parents=True)
    (fetched / "manifest.json").write_text("{}")
    assert locate.model_dir("gemma3-270m") == fetched
    made = tmp_path / "state" / "models" / "gemma3-270m"
    made.mkdir(parents=True)
    (made / "manifest.json").write_text("{}")
    assert locate.model_dir("gemma3-270m") == made
    with pytest.raises(SystemExit, match="make test"):
        locate.need_model(tmp_path / "nothing")
