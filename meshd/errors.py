"""The error hierarchy. Caught in three places only: the link read loop,
the HTTP handler, and the pipeline's retry loop.

The model side (shards/) has its own base, ``ShardsError``, and the wire (protocol/)
its ``ProtocolError``; they are re-exported here, one class each, so ``except
ModelError`` means the same in both. ``KNOWN_ERRORS`` is what a catch site names when it
takes any error raised on purpose, by meshd or by the model side."""

from protocol.errors import ProtocolError
from shards.errors import InvalidParams, KVFull, ModelError, ShardCorrupt, ShardMissing, ShardsError

__all__ = [
    "AuthError", "BadRequest", "ConfigError", "InvalidParams", "KNOWN_ERRORS", "KVFull", "MeshError", "ModelError",
    "NoCapacity", "PeerLost", "ProtocolError", "ShardCorrupt", "ShardMissing", "ShardsError", "StageFailed",
    "SupernodeChanged",
]


class MeshError(Exception):
    """Base of every error meshd raises on purpose."""


class ConfigError(MeshError):
    """A bad configuration value; the message names the key."""


class AuthError(ProtocolError):
    """A peer failed the handshake (wrong secret, version or mesh)."""


class PeerLost(MeshError):
    """A peer a request depended on went away."""


class Stopping(PeerLost):
    """This peer is stopping: its task group starts nothing new (to whoever asked, the
    peer is as good as lost)."""


class StageFailed(PeerLost):
    """A peer answered a step with Fail (its link is up): only a new plan helps."""


class NoCapacity(MeshError):
    """The mesh cannot hold or serve the model right now (HTTP 503)."""


class SupernodeChanged(NoCapacity):
    """This peer no longer serves as the supernode (it yielded, or it stops): the
    request goes on at the next one (an entry peer resubmits it with its tokens)."""


class BadRequest(MeshError):
    """A client request that cannot be served as asked (HTTP 4xx)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code  # OpenAI's error code, where it has one (context_length_exceeded)


class StorageFull(MeshError):
    """The state disk, or the batch store's configured bound, has no room (HTTP 507)."""


KNOWN_ERRORS = (MeshError, ShardsError, ProtocolError)
