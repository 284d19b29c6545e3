"""Names that come from a peer or a client and end up as directory names."""

MAX_NAME = 128


def is_plain_name(name: object) -> bool:
    """A model's name as it may come from a peer or a client: one path component that
    names something inside its parent (no separators, no ``.``/``..``, no hidden
    names, no control characters), so ``models/<name>`` stays inside ``models/``."""
    return (isinstance(name, str) and 0 < len(name) <= MAX_NAME and not name.startswith(".")
            and not any(c in name for c in "/\\") and name.isprintable())
