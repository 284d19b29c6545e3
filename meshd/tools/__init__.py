"""The tools around the daemon: command-line clients and helpers."""
