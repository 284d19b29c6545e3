"""What both converters' sources share: a table of weight-name templates per
format, read through one ``_get`` each."""

from __future__ import annotations

from typing import ClassVar

import torch

from shards.config import ModelConfig


class TensorSource:
    """A model file or directory, read tensor by tensor under our names."""

    EMBED_NAMES: ClassVar[dict[str, str]]  # our name -> theirs
    LAYER_NAMES: ClassVar[dict[str, str]]  # our name -> theirs, with {i} for the layer
    config: ModelConfig

    def _get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def embed_tensors(self) -> dict[str, torch.Tensor]:
        names = dict(self.EMBED_NAMES)
        if self.config.tie_embeddings:
            del names["output.weight"]
        return {ours: self._get(theirs) for ours, theirs in names.items()}

    def layer_tensors(self, i: int) -> dict[str, torch.Tensor]:
        return {ours: self._get(theirs.format(i=i)) for ours, theirs in self.LAYER_NAMES.items()}
