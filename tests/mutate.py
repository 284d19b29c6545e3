"""Valid JSON bodies with one thing changed, for the fuzz tests of what clients and peers
send: every place a value sits in a body, and a copy with one of them replaced."""

from __future__ import annotations

from collections.abc import Iterator


def paths(value, path: tuple = ()) -> Iterator[tuple]:
    """Every place in ``value`` (the root first) as a tuple of keys and indices."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, path + (i,))


def at(value, path: tuple):
    for step in path:
        value = value[step]
    return value


def replaced(value, path: tuple, new):
    """A copy of ``value`` with what sits at ``path`` replaced by ``new`` (``value`` is unchanged)."""
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy
