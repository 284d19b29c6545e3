"""Hostile input: whatever bytes arrive, decode returns a Message or raises
ProtocolError, never anything else, and never takes long.

Hypothesis mutates frames in-process; atheris (when installed) fuzzes
``protocol.codec.decode`` coverage-guided for a bounded time in a child process: any
exception but ProtocolError, a hang (per-input timeout) or memory over the RSS limit
fails it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.errors import ProtocolError
from protocol.codec import decode, encode
from protocol.messages import MESSAGE_TYPES

from .test_protocol import SAMPLES

FUZZ = settings(
    max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
FRAMES = [encode(m) for m in SAMPLES]
ATHERIS_SECONDS = 15

# Values a mutated field may take: every msgpack type, nested a little.
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def decodes_or_refuses(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data):
    decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from(FRAMES), st.data())
def test_byte_level_mutations(data, draw):
    buf = bytearray(data)
    for _ in range(draw.draw(st.integers(1, 8))):
        op = draw.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw.draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[at] = draw.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[at : at + draw.draw(st.integers(1, 16))]
        else:
            buf[at:at] = draw.draw(st.binary(min_size=1, max_size=8))
    decodes_or_refuses(bytes(buf))


def _paths(node, prefix=()):
    """Every key path into a decoded frame, nested maps and lists included."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


@FUZZ
@given(st.sampled_from(FRAMES), st.data())
def test_field_level_mutations(data, draw):
    frame = msgpack.unpackb(data, raw=False)
    paths = list(_paths(frame))
    for _ in range(draw.draw(st.integers(1, 3))):
        path = draw.draw(st.sampled_from(paths))
        node = frame
        try:
            for key in path[:-1]:
                node = node[key]
            if draw.draw(st.booleans()) and isinstance(node, dict):
                node.pop(path[-1], None)
            else:
                node[path[-1]] = draw.draw(wire_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation replaced a parent of this path
    decodes_or_refuses(msgpack.packb(frame, use_bin_type=True))


# -- atheris ------------------------------------------------------------------------------

ATHERIS_TARGET = textwrap.dedent("""
    import sys
    import atheris

    # Only our codec is instrumented (torch and msgpack are imported first, plain).
    import msgpack, torch
    from meshd.errors import ProtocolError
    import shards.span
    with atheris.instrument_imports(include=["protocol"]):
        from protocol import codec
        from protocol.messages import MESSAGE_TYPES

    def one(data):
        try:
            msg = codec.decode(data, max_size=1 << 20)
        except ProtocolError:
            return
        assert isinstance(msg, MESSAGE_TYPES), type(msg)
        codec.encode(msg)  # whatever decodes, encodes

    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
""")


@pytest.mark.timeout(120)
def test_atheris_decode(tmp_path):
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (pip install atheris)")
    from tests.test_protocol import SAMPLES

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, msg in enumerate(SAMPLES):
        (corpus / f"seed-{i}").write_bytes(encode(msg))
    script = tmp_path / "fuzz_decode.py"
    script.write_text(ATHERIS_TARGET)
    # libFuzzer reads the child's peak RSS, which on Linux starts at this process's peak
    # (kept across fork and exec): late in a suite that has loaded the real model that is
    # ~2.5 GB before one input runs. The fuzzer gets 2 GiB of its own on top.
    rss_limit = 2048 + resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(script), f"-max_total_time={ATHERIS_SECONDS}", "-timeout=2", f"-rss_limit_mb={rss_limit}",
         "-max_len=4096", "-print_final_stats=1", f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=ATHERIS_SECONDS + 60, cwd=root,
        env=os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    runs = re.search(r"Done (\d+) runs in (\d+) second", out)
    assert runs, out[-2000:]
    print(f"\natheris: {runs.group(1)} inputs in {runs.group(2)} s, no crash, hang or leak")
    assert int(runs.group(1)) > 1000
