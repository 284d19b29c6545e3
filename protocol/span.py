"""The one half-open layer span used by shards, protocol and placement. It lives in the
lowest layer, the wire's, so everything above can share it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """Transformer layers ``[start, stop)``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.stop):
            raise ValueError(f"bad span {self.start}:{self.stop}: need 0 <= start < stop")

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    @classmethod
    def parse(cls, text: str) -> Span:
        start, _, stop = text.partition(":")
        return cls(int(start), int(stop))

    def to_list(self) -> list[int]:
        return [self.start, self.stop]
