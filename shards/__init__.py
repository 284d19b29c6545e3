"""Model side of meshd: config, shard files, conversion, the stage forward."""
