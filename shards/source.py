"""What both converters' sources share: reading our tensors through the model family's
name tables, each source with its own ``_get``."""

from __future__ import annotations

from typing import cast

import torch

from shards.errors import ModelError
from shards.config import ModelConfig
from shards.families import Family


class TensorSource:
    """A model file or directory, read tensor by tensor under our names."""

    format: str  # "hf" | "gguf": which of the family's tables apply
    family: Family
    config: ModelConfig
    architecture: str

    def _get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    # (``_get`` gives tensors, and the family's row transforms keep them tensors)
    def embed_tensors(self) -> dict[str, torch.Tensor]:
        return cast("dict[str, torch.Tensor]", self.family.read(self.format, self._get, self.config, None))

    def layer_tensors(self, i: int) -> dict[str, torch.Tensor]:
        return cast("dict[str, torch.Tensor]", self.family.read(self.format, self._get, self.config, i))

    def _check_all_used(self, present: set[str], extra: set[str], where: str) -> None:
        """A tensor the family does not read is a part of the model the forward would
        leave out (a bias, an expert, a new norm): refuse rather than run it wrong."""
        unused = present - self.family.source_names(self.format, self.config) - extra
        if unused:
            shown = ", ".join(sorted(unused)[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
            raise ModelError(f"{where}: tensors {shown} are not used by the {self.family.name} forward; "
                             "this model has parts meshd does not implement")
