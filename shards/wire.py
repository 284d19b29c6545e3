"""Torch tensors to and from the wire's ``WireTensor`` (protocol/ holds no torch).

``to_wire`` makes at most one copy before msgpack's own: a gather into contiguous memory on
the tensor's device, or the device-to-host transfer (never both for a contiguous CUDA
tensor); a contiguous CPU tensor travels as a view of its own memory. ``from_wire`` copies the
frame's bytes once, so the tensor owns writable memory and does not pin the frame.
"""

from __future__ import annotations

import torch

from protocol.messages import WireTensor

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_WIRE_NAME = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def to_wire(t: torch.Tensor) -> WireTensor:
    name = _WIRE_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"cannot send dtype {t.dtype}; allowed: {', '.join(TORCH_DTYPES)}")
    if t.device.type == "cpu" and t.dtype != torch.bfloat16 and t.numel() and t.dim() and t.is_contiguous():
        # A hidden state as an engine hands it over: its own memory as it is, with fewer
        # torch calls (each costs the event loop more than the bytes do).
        data = memoryview(t.detach().numpy())  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
        return WireTensor(name, tuple(t.shape), data.cast("B"))
    host = t.detach().contiguous().cpu()
    flat = host.reshape(-1).view(torch.uint8).numpy()
    data = memoryview(flat)  # type: ignore[arg-type]  # numpy stubs: __buffer__ only on 3.12+
    return WireTensor(name, tuple(host.shape), data)


def from_wire(w: WireTensor) -> torch.Tensor:
    """The tensor of a ``WireTensor`` the codec checked (dtype, shape and byte count agree)."""
    dtype = TORCH_DTYPES[w.dtype]
    if not len(w.data):
        return torch.empty(w.shape, dtype=dtype)  # frombuffer refuses empty buffers
    return torch.frombuffer(bytearray(w.data), dtype=dtype).reshape(w.shape)
