"""The model's shape: one frozen dataclass, as in gpt-fast's ModelArgs.

The fields below ``eos_token_ids`` are the switches of the shared forward that the model
families set (a Llama needs none of them): rope scaling, sliding-window layers, biases,
norms and activations. The manifest leaves out a switch that is at its default, so a
Llama's manifest reads as it did before the families came.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shards.errors import ModelError

LAYER_KINDS = ("full", "sliding")
# Bounds on a config's sizes: a manifest may come from a peer, and every one of these
# sizes a tensor or divides another (n_kv_heads 0 was a ZeroDivisionError in a stage).
# The context (max_position) sizes nothing in the file, so nothing there backs a claim:
# 2^24 is past every published model's (Llama 4 Scout's 10M the longest), and a file
# that claims more (2^28) is refused at conversion rather than served on its word.
MAX_CONTEXT = 1 << 24
SIZE_BOUNDS = {"n_layers": 1 << 16, "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "n_heads": 1 << 12,
               "n_kv_heads": 1 << 12, "head_dim": 1 << 14, "vocab_size": 1 << 24, "max_position": MAX_CONTEXT}
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_KINDS = ("linear", "dynamic", "llama3", "factors")


def _positive(value: object) -> bool:
    """A finite number above zero (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rope frequencies other than ``theta ** (-2i / hd)``.

    linear   every inverse frequency / factor
    dynamic  NTK: theta grows with the sequence length past original_max_position
    llama3   Llama 3.1's smooth blend between low and high frequencies
    factors  each inverse frequency / its own factor (a GGUF file's ``rope_freqs``)
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position: int | None = None
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelError(f"rope scaling {self.kind!r} is not supported (known: {', '.join(ROPE_KINDS)})")
        need = {"dynamic": ("original_max_position",),
                "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position")}.get(self.kind, ())
        for name in need:
            if getattr(self, name) is None:
                raise ModelError(f"rope scaling {self.kind} needs {name}")
        if self.kind == "factors" and not self.freq_factors:
            raise ModelError("rope scaling by factors needs freq_factors")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ModelError(f"rope scaling {name}={value!r} must be a finite positive number")
        if self.low_freq_factor is not None and self.low_freq_factor == self.high_freq_factor:
            raise ModelError("rope scaling low_freq_factor and high_freq_factor must differ")
        if self.original_max_position is not None and (type(self.original_max_position) is not int
                                                       or self.original_max_position < 1):
            raise ModelError(f"rope scaling original_max_position={self.original_max_position!r} must be an "
                             "integer from 1")
        if not all(_positive(f) for f in self.freq_factors):
            raise ModelError("rope scaling freq_factors must be finite positive numbers")

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in fields(self) if (v := getattr(self, f.name)) not in (None, ())}

    @classmethod
    def from_dict(cls, d: dict) -> RopeScaling:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["freq_factors"] = tuple(float(x) for x in kwargs.get("freq_factors", ()))
        return cls(**kwargs)


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
    # -- the families' switches (defaults: a Llama) ----------------------------------
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None  # sliding layers' own rope base, unscaled (Gemma 3)
    sliding_window: int | None = None  # a sliding layer sees this many positions, itself included
    layer_types: tuple[str, ...] = ()  # "full" | "sliding" per layer; empty: all full
    attn_bias: bool = False  # q, k, v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's q and k before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma 3)
    hidden_act: str = "silu"  # of the gated MLP: silu | gelu_tanh
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention softmax scale; None: head_dim ** -0.5
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        for name, hi in SIZE_BOUNDS.items():
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= hi:
                raise ModelError(f"model config {name}={value!r} must be an integer in 1..{hi}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ModelError(f"model config {name}={value!r} must be a finite non-negative number")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        for name in ("n_layers", "hidden_size", "intermediate_size", "n_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"model config {name}={getattr(self, name)} must be positive")
        if self.head_dim % 2:
            raise ModelError(f"head_dim={self.head_dim} must be even for rope")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelError(f"activation {self.hidden_act!r} is not supported (known: {', '.join(ACTIVATIONS)})")
        for name in ("rope_local_theta", "embed_scale", "query_scale", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ModelError(f"model config {name}={value!r} must be a finite positive number")
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            raise ModelError(f"model config sliding_window={self.sliding_window!r} must be an integer from 1")
        rs = self.rope_scaling
        if rs is not None and rs.freq_factors and len(rs.freq_factors) != self.head_dim // 2:
            raise ModelError(f"rope scaling names {len(rs.freq_factors)} freq_factors, head_dim {self.head_dim} "
                             f"has {self.head_dim // 2} frequencies")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ModelError(f"layer_types names {len(self.layer_types)} layers, the model has {self.n_layers}")
            if bad := set(self.layer_types) - set(LAYER_KINDS):
                raise ModelError(f"layer types {sorted(bad)} not one of {', '.join(LAYER_KINDS)}")
            if "sliding" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ModelError("sliding layers need a positive sliding_window")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

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
        kwargs["layer_types"] = tuple(str(t) for t in kwargs.get("layer_types", ()))
        if kwargs.get("rope_scaling") is not None:
            kwargs["rope_scaling"] = RopeScaling.from_dict(kwargs["rope_scaling"])
        return cls(**kwargs)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _SWITCHES and value == f.default:
                continue  # a Llama's manifest stays as it was
            out[f.name] = value
        out["eos_token_ids"] = list(self.eos_token_ids)
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        return out


# The fields a family sets; left out of the manifest while at their defaults.
_SWITCHES = ("rope_scaling", "rope_local_theta", "sliding_window", "layer_types", "attn_bias", "qk_norm",
             "sandwich_norms", "hidden_act", "embed_scale", "query_scale", "final_softcap")
