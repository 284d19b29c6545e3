"""meshd: a peer-to-peer inference mesh for home labs."""

__version__ = "0.1.0"
