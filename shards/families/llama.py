"""Llama 2 / 3 / 3.1 / 3.2 and Mistral: the plain layout every other family starts from.

Llama 3.1's rope scaling comes as ``rope_type: llama3`` from Hugging Face and as a
``rope_freqs`` tensor of per-frequency divisors from llama.cpp (which names the scaling
nowhere else). llama.cpp reorders the Q/K rows of "llama" files for its interleaved rope.
Mistral has the Llama layout, with every layer sliding when its config has a window;
llama.cpp writes Mistral as "llama" and drops the window (it runs such files with full
attention, and so does a conversion of them).
"""

from __future__ import annotations

from typing import ClassVar

from shards.families.base import Family, HFConfig


class Llama(Family):
    name = "llama"
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architecture: ClassVar[str | None] = "llama"
    gguf_permuted = True


class Mistral(Llama):
    name = "mistral"
    hf_architectures = ("MistralForCausalLM",)
    gguf_architecture = None  # its GGUF files say "llama"

    def hf_switches(self, hf: HFConfig, base: dict) -> dict:
        # transformers' MistralConfig defaults to a 4096 window when the key is absent.
        window = hf.data.get("sliding_window", 4096)
        if window is None:
            return super().hf_switches(hf, base)
        return super().hf_switches(hf, base) | {"sliding_window": int(window),
                                                 "layer_types": ("sliding",) * base["n_layers"]}
