"""The one half-open layer span (defined with the wire format, the lowest layer)."""

from protocol.span import Span

__all__ = ["Span"]
