"""The serving path: the HTTP API, the entry peer's proxy, the supernode's scheduler
and pipeline, batch jobs, and what a peer shows of itself (status, metrics, dashboard)."""
