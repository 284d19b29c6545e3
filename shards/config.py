"""The model's shape: one frozen dataclass, as in gpt-fast's ModelArgs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from shards.errors import ModelError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    n_layers: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position: int
    tie_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config {name}={getattr(self, name)} must be positive")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        missing = [n for n in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "n_kv_heads",
                               "head_dim", "rope_theta", "rms_norm_eps", "vocab_size", "max_position",
                               "tie_embeddings") if n not in data]
        if missing:
            raise ModelError(f"model config lacks {', '.join(missing)}")
        # Unknown keys are ignored: a newer manifest may carry more.
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["eos_token_ids"] = tuple(int(i) for i in kwargs.get("eos_token_ids", ()))
        return cls(**kwargs)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out
