"""The serving path: what answers requests (the API, the scheduler, batch jobs)."""
