"""KV admission on the supernode: what running sessions hold of the stages' KV caches,
against a budget of positions, counted in the unit the stages allocate.

A stage's cache for a session grows a chunk at a time (``KVCache.CHUNK`` positions) and
keeps its chunks when cut back, so a session that may reach ``n`` positions holds
``KVCache.room_for(n)`` of memory on every stage: that is what it is charged, not ``n``
(a 40-token answer to a 20-token prompt holds a whole chunk of 256). The prefix cache's
entries count the same way (``PrefixCache.held``).

Two shares inside the budget: one client (an API key, an address) with requests in flight
holds at most CLIENT_SHARE of it, and batch-job sessions at most BATCH_KV_SHARE. The
scheduler asks ``refusal`` before it admits, then ``reserve`` and ``release`` a session's
charge, once each.
"""

from __future__ import annotations

from shards.layers import KVCache

# A client with requests in flight may hold at most this share of the KV budget (its one
# request, all its choices, is admitted whenever the budget fits it): no client can lock
# every other client out.
CLIENT_SHARE = 0.5
# Batch-job lines (meshd/serving/batch.py) reserve at most this share, so room for
# interactive requests stays free (beyond it they get a 503 and the batch runner retries).
BATCH_KV_SHARE = 0.75


def charge(positions: int) -> int:
    """KV positions of memory a session that may reach ``positions`` holds on a stage."""
    return KVCache.room_for(positions)


class KVBudget:
    def __init__(self, total: int | None = None):
        self.total = total  # positions; None: no budget
        self.reserved = 0  # charged to running sessions
        self.batch = 0  # of ``reserved``, batch-job sessions'
        self.by: dict[object, int] = {}  # of ``reserved``, per client, and per request (("request", r))

    def refusal(self, need: int, client: object | None, request: object, batch: bool) -> str | None:
        """Why ``need`` more positions cannot be admitted for a session of ``client``'s
        ``request`` (None: they can); cached prefixes are not counted (they go first)."""
        if self.total is None:
            return None
        budget = self.total
        if self.reserved + need > budget:
            return (f"KV cache budget full: {self.reserved} of {budget} positions in use, "
                    f"this request needs {need}; retry shortly")
        held = self.by.get(client, 0) if client is not None else 0
        others = held - self.by.get(("request", request), 0)  # its other requests'
        if others > 0 and held + need > budget * CLIENT_SHARE:
            return (f"this client holds {held} of the {budget} KV positions (at most {int(budget * CLIENT_SHARE)} "
                    f"while others may need them), this request needs {need}; retry once one of its requests ends")
        if batch and self.batch and self.batch + need > budget * BATCH_KV_SHARE:
            return (f"batch jobs hold their share of the KV cache budget ({self.batch} of "
                    f"{budget} positions); retry shortly")
        return None

    def over(self, need: int, cached: int) -> bool:
        """Whether ``need`` more beside the running sessions and ``cached`` positions of
        cached prefixes passes the budget (then a cached prefix goes)."""
        return self.total is not None and self.reserved + cached + need > self.total

    def reserve(self, need: int, client: object | None, request: object, batch: bool) -> None:
        self.reserved += need
        if batch:
            self.batch += need
        if client is not None:
            for key in (client, ("request", request)):
                self.by[key] = self.by.get(key, 0) + need

    def release(self, need: int, client: object | None, request: object, batch: bool) -> None:
        self.reserved -= need
        if batch:
            self.batch -= need
        if client is not None and need:
            for key in (client, ("request", request)):
                left = self.by.get(key, 0) - need
                if left > 0:
                    self.by[key] = left
                else:
                    self.by.pop(key, None)
