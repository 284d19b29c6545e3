"""The wire's own error. ``protocol/`` is the lowest layer and imports nothing of meshd or
shards: the daemon re-exports this class in ``meshd.errors`` (one class on both sides, so
``except ProtocolError`` means the same everywhere) and counts it among its known errors."""


class ProtocolError(Exception):
    """A malformed, oversize or out-of-order frame; closes that one link."""
