"""Make tests/data/gguf-blocks.gguf: 64-row slices of real tensors, their blocks kept raw.

Each GGUF type's blocks come from llama.cpp's own quantizer (``llama-quantize``) or from
the Gemma 3 270M Q4_K_M file; slicing rows keeps the blocks as they are (a row is whole
blocks). CI has no llama.cpp build, so the small result is committed and this script is
how it was made:

    dir=$(../shared/tools/llama-cpp)
    q=$dir/bin/llama-quantize
    $q --allow-requantize state/cache/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/g/smol-F16.gguf F16
    for t in Q4_0 Q5_0 Q5_1 Q8_0 Q4_K_S Q5_K_S Q6_K BF16; do $q /tmp/g/smol-F16.gguf /tmp/g/smol-$t.gguf $t; done
    .venv/bin/python tests/data/make_gguf_blocks.py /tmp/g gemma-3-270m-q4_k_m.gguf state/cache/SmolLM2-135M-Instruct.Q4_1.gguf

Tensor names: ``<TYPE>.<source>.<GGUF tensor name>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

ROWS = 64
OUT = Path(__file__).with_name("gguf-blocks.gguf")


def slices(path: Path, source: str, want: set[str]):
    """The first 2-D tensor of each wanted type whose row is whole 256-blocks if it can be."""
    tensors = sorted(GGUFReader(str(path)).tensors, key=lambda t: (int(t.shape[0]) % 256 != 0, t.name))
    for t in tensors:
        name = t.tensor_type.name
        if name in want and len(t.shape) == 2:
            want.discard(name)
            yield f"{name}.{source}.{t.name}", t


def main(quantized_dir: str, gemma: str, q4_1: str) -> None:
    w = GGUFWriter(str(OUT), arch="slices")
    picked = []
    for p in sorted(Path(quantized_dir).glob("smol-*.gguf")):
        picked += slices(p, "smollm2", {"Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16"})
    picked += slices(Path(q4_1), "smollm2", {"Q4_1"})
    picked += slices(Path(gemma), "gemma3", {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})
    seen = set()
    for name, t in picked:
        if name.split(".")[0] + name.split(".")[1] in seen:
            continue
        seen.add(name.split(".")[0] + name.split(".")[1])
        rows = np.ascontiguousarray(t.data[:ROWS])
        w.add_tensor(name, rows, raw_dtype=t.tensor_type)
        if t.tensor_type == T.F16:  # F32 from the same weights: llama.cpp's files have no 2-D F32
            w.add_tensor(name.replace("F16.", "F32.", 1), rows.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(OUT, OUT.stat().st_size, "bytes")


if __name__ == "__main__":
    main(*sys.argv[1:])
