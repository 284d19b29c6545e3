"""manifest.json: what a model directory holds, with the size and sha256 of every file.

The manifest is written last during conversion, so a directory with a manifest is a
complete one; a peer checks each file it opens against it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from protocol.names import is_plain_name
from shards.errors import ModelError, ShardCorrupt, ShardMissing
from shards.config import ModelConfig
from shards.span import Span

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
EMBED_FILE = "embed.safetensors"
_CHUNK = 1 << 20
MAX_FILE_NAME = 200  # bytes of a shard file's name (file systems refuse past 255)


def layer_file(i: int) -> str:
    return f"layer-{i:03d}.safetensors"


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """Stream a file through sha256; ``progress(n)`` is called with each chunk's size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def check_file_name(name: str) -> str:
    """A manifest names plain files inside the model directory, nothing else."""
    p = PurePosixPath(name)
    if (not name or "/" in name or "\\" in name or "\x00" in name or p.is_absolute()
            or name in (".", "..") or name.startswith("..") or os.sep in name
            or (os.altsep is not None and os.altsep in name)):
        raise ModelError(f"manifest file name {name!r} points outside the model directory")
    return name


def check_shard_name(name: str) -> str:
    """A name a manifest may list: a plain file (``check_file_name``), and not the manifest
    itself, a hidden or partial file, or a name a file system refuses as too long."""
    check_file_name(name)
    if name.startswith(".") or name == MANIFEST_FILE or len(name.encode("utf-8", "surrogatepass")) > MAX_FILE_NAME:
        raise ModelError(f"manifest file name {name[:80]!r} is not a shard file's (hidden, the manifest itself, "
                         f"or longer than {MAX_FILE_NAME} bytes)")
    return name


def check_model_name(name: object) -> str:
    if not isinstance(name, str) or not is_plain_name(name):  # (is_plain_name checks it is a str too)
        raise ModelError(f"model name {str(name)[:80]!r} is not a plain name (it would be used as a directory)")
    return name


@dataclass(frozen=True, slots=True)
class FileEntry:
    sha256: str
    size: int
    resident: int | None = None  # bytes once loaded, where not ``size`` (quantized: kernel layouts)


@dataclass(frozen=True)
class Manifest:
    name: str
    architecture: str
    config: ModelConfig
    dtype: str
    files: dict[str, FileEntry]
    chat_template: str | None = None
    # Weight-only quantization: {"kind": "int8"|"int4", "group_size", "head", "head_kind"} of a
    # requantization (``dtype`` is then its kind), or {"kind": "gguf"} for a GGUF kept as shipped
    # (``dtype`` is its file type, q4_k_m...); with "tensors": one record per quantized linear
    # (shards/quant.py's TensorQuant), which loading builds the modules from. None: plain floats.
    quant: dict | None = None
    # Texts of bos_token, eos_token, unk_token, pad_token for chat templates (None: none known).
    special_tokens: dict[str, str] | None = None
    format: int = FORMAT_VERSION
    _raw: bytes | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in self.files:
            check_shard_name(name)

    @property
    def n_layers(self) -> int:
        return self.config.n_layers

    # -- serialisation -------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": self.format,
            "name": self.name,
            "architecture": self.architecture,
            "dtype": self.dtype,
            "n_layers": self.n_layers,
            "config": self.config.to_dict(),
            "chat_template": self.chat_template,
            "files": {n: {"sha256": e.sha256, "size": e.size} | ({"resident": e.resident} if e.resident else {})
                      for n, e in sorted(self.files.items())},
        } | ({"quant": dict(self.quant)} if self.quant else {}) | (
            {"special_tokens": dict(self.special_tokens)} if self.special_tokens else {})

    def to_bytes(self) -> bytes:
        if self._raw is not None:
            return self._raw
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        try:
            data = json.loads(raw)
            if data.get("format", 1) > FORMAT_VERSION:
                raise ModelError(f"manifest format {data['format']} is newer than this meshd ({FORMAT_VERSION})")
            config = ModelConfig.from_dict(data["config"])
            if data.get("n_layers", config.n_layers) != config.n_layers:
                raise ModelError(f"manifest n_layers={data['n_layers']} disagrees with config ({config.n_layers})")
            files = {str(n): _file_entry(e) for n, e in data["files"].items()}
            return cls(name=str(data["name"]), architecture=str(data["architecture"]), config=config,
                       dtype=str(data["dtype"]), files=files, chat_template=data.get("chat_template"),
                       quant=data.get("quant"), special_tokens=_special_tokens(data.get("special_tokens")),
                       format=int(data.get("format", 1)), _raw=raw)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError) as e:
            raise ModelError(f"malformed manifest: {e!r}") from e

    @classmethod
    def load(cls, model_dir: Path) -> Manifest:
        path = Path(model_dir) / MANIFEST_FILE
        if not path.is_file():
            raise ModelError(f"{model_dir} is not a model directory: no {MANIFEST_FILE}")
        return cls.from_bytes(path.read_bytes())

    def write(self, model_dir: Path) -> Path:
        """Write atomically (temp file + rename), so readers never see half a manifest."""
        path = Path(model_dir) / MANIFEST_FILE
        tmp = path.with_name(f".{MANIFEST_FILE}.tmp")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)
        return path

    @property
    def digest(self) -> str:
        """sha256 hex of the manifest.json bytes: the model's identity in a plan."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    # -- which files a stage needs ---------------------------------------------------

    def files_for(self, span: Span | None, embed: bool) -> list[str]:
        """Files a stage with ``span`` needs; ``embed`` covers embedding, norm, head and tokenizer."""
        names: list[str] = []
        if embed:
            names += [EMBED_FILE, TOKENIZER_FILE]
        if span is not None:
            if span.stop > self.n_layers:
                raise ModelError(f"span {span} exceeds the model's {self.n_layers} layers")
            names += [layer_file(i) for i in span]
        for n in names:
            if n not in self.files:
                raise ModelError(f"manifest lists no {n}")
        return names

    def layer_bytes(self, i: int) -> int:
        """Bytes layer ``i`` takes in a peer's memory (what placement counts)."""
        e = self.files[layer_file(i)]
        return e.resident or e.size

    @property
    def embed_bytes(self) -> int:
        e = self.files[EMBED_FILE]
        return e.resident or e.size

    # -- checking files against it --------------------------------------------------

    def verify(self, model_dir: Path, names: Iterable[str] | None = None,
               progress: Callable[[int], None] | None = None) -> None:
        """Raise ShardMissing / ShardCorrupt naming the first bad file; size first, then sha256.

        A file whose (size, mtime, ctime, inode) is what it was when it last hashed
        right is not hashed again (a ``.<dir>.verified.json`` beside the directory, which
        stays as converted): a restart loads in seconds, and any write to the file,
        which moves its ctime, makes it hash again."""
        checked = _VerifiedCache(Path(model_dir))
        try:
            for name in (self.files if names is None else names):
                check_file_name(name)
                entry = self.files.get(name)
                if entry is None:
                    raise ModelError(f"manifest lists no {name}")
                path = Path(model_dir) / name
                if not path.is_file():
                    raise ShardMissing(f"{name} is missing from {model_dir}")
                st = path.stat()
                if st.st_size != entry.size:
                    raise ShardCorrupt(f"{name} is {st.st_size} bytes, manifest says {entry.size}")
                if checked.holds(name, st, entry.sha256):
                    if progress is not None:
                        progress(st.st_size)
                    continue
                digest = sha256_file(path, progress)
                if digest != entry.sha256:
                    raise ShardCorrupt(f"{name} sha256 {digest[:12]}… does not match manifest {entry.sha256[:12]}…")
                checked.record(name, st, digest)
        finally:
            checked.save()


MAX_FILE_SIZE = 1 << 44


def _file_entry(e: dict) -> FileEntry:
    sha, size = e["sha256"], e["size"]
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        raise ModelError(f"manifest sha256 {str(sha)[:80]!r} is not 64 lowercase hex digits")
    if type(size) is not int or not 0 <= size <= MAX_FILE_SIZE:
        raise ModelError(f"manifest file size {size!r} is outside 0..{MAX_FILE_SIZE}")
    resident = e.get("resident")
    if resident is not None and (type(resident) is not int or not 0 <= resident <= MAX_FILE_SIZE):
        raise ModelError(f"manifest resident size {resident!r} is outside 0..{MAX_FILE_SIZE}")
    return FileEntry(sha, size, resident)


def _special_tokens(data) -> dict[str, str] | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ModelError("manifest special_tokens must map names to token texts")
    return dict(data)


class _VerifiedCache:
    """What ``Manifest.verify`` already hashed: name -> [size, mtime_ns, ctime_ns, ino, sha256]."""

    def __init__(self, model_dir: Path):
        model_dir = model_dir.resolve()
        self.path = model_dir.parent / f".{model_dir.name}.verified.json"
        self.dirty = False
        try:
            self.seen = json.loads(self.path.read_text())
            if not isinstance(self.seen, dict):
                self.seen = {}
        except (OSError, ValueError):
            self.seen = {}

    @staticmethod
    def _key(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]

    def holds(self, name: str, st: os.stat_result, sha256: str) -> bool:
        return self.seen.get(name) == self._key(st) + [sha256]

    def record(self, name: str, st: os.stat_result, sha256: str) -> None:
        self.seen[name] = self._key(st) + [sha256]
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.seen))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only model directory: hash again next time
