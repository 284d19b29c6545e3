"""The model side's own errors. shards/ imports nothing of meshd: the daemon
re-exports these in ``meshd.errors`` and maps them where it catches them (a
model that cannot load rejects the plan; bad sampling parameters are a 400)."""


class ShardsError(Exception):
    """Base of every error shards/ raises on purpose."""


class ModelError(ShardsError):
    """A model directory or source file that cannot be used."""


class CacheMissing(ModelError):
    """A step names a session at a position its stage holds no cache for (its cache was
    dropped under it): the session replays from 0."""


class KVFull(ModelError):
    """A step would grow this stage's KV caches past the stage's own limit (its share of
    its peer's memory): the step's sessions cannot go on here now."""


class ShardMissing(ShardsError):
    """A shard file is absent from the model directory."""


class ShardCorrupt(ShardsError):
    """A shard file's size or sha256 does not match the manifest."""


class InvalidParams(ShardsError, ValueError):
    """Generation parameters out of range; ``param`` names the one at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
