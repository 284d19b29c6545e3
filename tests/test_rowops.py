"""shards/rowops.py: a block with its small steps fused in C computes what the torch block
does, for every family switch, float and int4 weights, decode rows and prompt chunks mixed
in one batch; a row's result does not depend on what else is in its batch; decode rows run
as a whole block in C (ro_block) give the very bits of the step-by-step path, with every
linear on the block kernel or some on torch's; and without a compiler the torch forward runs."""

from __future__ import annotations

import copy

import pytest
import torch

from shards import qblocks, qlinear, rowops
from shards.config import ModelConfig
from shards.model import Stage, fuse, rope_tables
from shards.quant import QuantSpec, TensorQuant
from shards.span import Span

LIB = rowops.library_for(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build shards/rowops.c")

BASE = dict(n_layers=2, hidden_size=64, intermediate_size=160, n_heads=4, n_kv_heads=2, head_dim=16,
            rope_theta=10000.0, rms_norm_eps=1e-6, vocab_size=50, max_position=512, tie_embeddings=False)
CONFIGS = {
    "llama": {},
    "qwen2": {"attn_bias": True, "n_kv_heads": 1},
    "gemma3": {"qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh", "sliding_window": 5,
               "layer_types": ("sliding", "full"), "rope_local_theta": 10000.0, "query_scale": 0.2},
}


# Linears on Q8_0 blocks (a GGUF file's), some on torch's int4 kernel (the rest of the name):
# the C steps then read what torch gave for q/k/v and w2, or for wo and gate/up; "apart"
# leaves q/k/v and gate/up unfused (three int4 linears side by side, two Q8_0 ones).
BLOCKS = {"blocks": (), "blocks+int4 qkv w2": ("wqkv", "w2"), "blocks+int4 wo w13": ("wo", "w13"),
          "blocks apart": ("wq", "wk", "wv")}
RUNS = {"blocks": ["c"], "blocks+int4 qkv w2": ["c", "torch", "c", "torch", "c"],
        "blocks+int4 wo w13": ["c", "torch", "c", "torch", "c"], "blocks apart": ["c", "torch", "c"]}


def _stage(name: str, weights: str) -> Stage:
    torch.manual_seed(0)
    stage = Stage(ModelConfig(**(BASE | CONFIGS[name])), Span(0, 2), embed=False, head=False)
    with torch.no_grad():
        for n, p in stage.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.2 * torch.randn_like(p))
    if weights != "blocks apart":
        fuse(stage)
    if weights == "float":  # on the row-invariant float kernel, as a CPU stage loads them
        assert qlinear.exact_floats(stage, qblocks.library()) > 0
    elif weights == "float torch":  # torch's GEMM: a row's sums depend on how many rows run
        pass
    elif weights == "int4":
        qlinear.quantize_stage(stage, QuantSpec("int4", 32))
    elif weights in BLOCKS:
        for i, m in enumerate(m for m in stage.modules() if hasattr(m, "eps")):
            m.eps = 1e-6 * (i + 1)  # each norm its own eps: a plan that swapped two would show
        qlinear._swap_linears(stage, _q8_0)
        for b in stage.layers.values():
            for part in (b.attention, b.feed_forward):
                for name_ in BLOCKS[weights]:
                    if isinstance(m := getattr(part, name_, None), qlinear.QuantLinear):
                        setattr(part, name_, qlinear.QuantLinear.from_weight(m.dense_weight(torch.float32), "int4",
                                                                            32, m.bias))
        qlinear.prepare(stage, torch.float32)
    return stage.eval()


def _q8_0(_key: str, m: torch.nn.Linear) -> qlinear.QuantLinear:
    """m's weight in Q8_0's layout: int8 codes, an fp16 scale a group of 32."""
    w = m.weight.detach().reshape(m.out_features, -1, 32)
    s = (w.abs().amax(-1) / 127).clamp(min=1e-6).half().float()
    q = torch.round(w / s[..., None]).clamp(-127, 127).to(torch.int8).reshape(m.out_features, -1)
    out = qlinear.QuantLinear(m.in_features, m.out_features, TensorQuant("int8", 32, False, "Q8_0"),
                              bias=m.bias is not None)
    out.qweight, out.scales = q, s
    if m.bias is not None:
        out.bias = torch.nn.Parameter(m.bias.detach().clone())
    return out


def _forward(stage: Stage, lib, x: torch.Tensor, batch) -> torch.Tensor:
    stage.rowops = lib
    with torch.inference_mode():
        return stage.forward_batch(x, batch)


@pytest.mark.parametrize("weights", ["float", "int4"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_fused_block_computes_what_the_torch_block_does(name, weights):
    stage = _stage(name, weights)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, 64, generator=gen) for n in (9, 3)]
    runs = {}
    for label, lib in (("torch", None), ("fused", LIB)):
        caches = [stage.new_caches() for _ in prompts]
        outs = [_forward(stage, lib, p, [(0, len(p), c)]) for p, c in zip(prompts, caches)]
        # one step: a decode row of each session and a new prompt's chunk, in one batch
        new = stage.new_caches()
        rows = torch.cat([prompts[0][:1] * 0.5, torch.randn(4, 64, generator=torch.Generator().manual_seed(2)),
                          prompts[1][:1] * 0.5])
        outs.append(_forward(stage, lib, rows, [(9, 1, caches[0]), (0, 4, new), (3, 1, caches[1])]))
        runs[label] = outs, caches + [new]
    (want, want_c), (got, got_c) = runs["torch"], runs["fused"]
    # int4: the kernels round their input to bf16, so a last-bit difference before them can
    # move an input by one bf16 step (2^-8 relative) and the output by about that much
    tol = 1e-5 if weights == "float" else 2e-2
    for w, g in zip(want, got):
        assert ((w - g).abs().max() / w.abs().max()).item() < tol
    for wc, gc in zip(want_c, got_c):
        for layer in wc:
            n = wc[layer].length
            assert gc[layer].length == n
            assert ((wc[layer].k[:, :n] - gc[layer].k[:, :n]).abs().max() / wc[layer].k[:, :n].abs().max()) < tol


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_rows_result_does_not_depend_on_its_batch(name):
    """What makes batched generation equal plain generation token for token."""
    stage = _stage(name, "int4")
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(7, 64, generator=gen), torch.randn(6, 64, generator=gen)
    ca, cb = stage.new_caches(), stage.new_caches()
    _forward(stage, LIB, a, [(0, 7, ca)])
    _forward(stage, LIB, b, [(0, 6, cb)])
    step = torch.randn(1, 64, generator=gen)
    alone = _forward(stage, LIB, step, [(7, 1, copy.deepcopy(ca))])
    other = torch.randn(3, 64, generator=gen)
    mixed = _forward(stage, LIB, torch.cat([other[:1], step, other[1:]]),
                     [(6, 1, cb), (7, 1, ca), (0, 2, stage.new_caches())])
    assert torch.equal(mixed[1:2], alone)


def _cut_differently(stage: Stage) -> list:
    """The cuts of a 23-row prompt whose rows differ from the whole chunk's."""
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(5))
    whole = _forward(stage, LIB, x, [(0, 23, stage.new_caches())])
    differ = []
    for cuts in ([1], [7], [22], [3, 9, 17], list(range(1, 23))):
        caches, parts = stage.new_caches(), []
        for a, b in zip([0] + cuts, cuts + [23]):
            parts.append(_forward(stage, LIB, x[a:b], [(a, b - a, caches)]))
        if not torch.equal(torch.cat(parts), whole):
            differ.append(cuts)
    return differ


@pytest.mark.parametrize("weights", ["float", "int4", "blocks"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_prompts_rows_have_the_same_bits_in_a_chunk_of_any_length_as_decoded_alone(name, weights):
    """What exact replay, the prefix cache and speculative drafts rest on: a row's hidden
    state after the span is the same bits whether it ran inside the whole prompt's chunk,
    in a chunk cut anywhere (a replay, a cached prefix, a draft's rows), or alone, one row
    after another as a decode runs. (Gemma's config has a sliding window of 5: the cuts
    fall inside and past it.) Float weights on torch's GEMM do not (shown below)."""
    stage = _stage(name, weights)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(5))
    whole = _forward(stage, LIB, x, [(0, 23, stage.new_caches())])
    assert _cut_differently(stage) == []
    # and beside another session's rows in one batch
    other = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    caches = stage.new_caches()
    _forward(stage, LIB, x[:20], [(0, 20, caches)])
    mixed = _forward(stage, LIB, torch.cat([other, x[20:]]), [(0, 4, stage.new_caches()), (20, 3, caches)])
    assert torch.equal(mixed[4:], whole[20:])


def test_float_weights_on_torchs_gemm_are_not_row_invariant_which_is_why_they_run_in_c():
    """The test above would catch a float linear left on torch's GEMM (MKL sums a row in
    another order alone than among others)."""
    assert _cut_differently(_stage("llama", "float torch")) != []


def test_the_float_kernel_gives_a_rows_bits_whatever_rows_run_with_it_and_agrees_with_float64():
    """A row alone (a decode row), in decode batches and prefill chunks of 2 to 64 rows, and
    read from rows further apart: the same bits; float32 and bf16 weights; K a multiple of
    the 16 lanes, and not."""
    lib = qblocks.library()
    gen = torch.Generator().manual_seed(7)
    for k, n in ((64, 48), (576, 203), (100, 37)):
        w, x, b = torch.randn(n, k, generator=gen), torch.randn(64, k, generator=gen), torch.randn(n, generator=gen)
        for weight in (w, w.bfloat16()):
            y = qblocks.dense(lib, x, weight, b)
            want = torch.nn.functional.linear(x.double(), weight.double(), b.double())
            assert (y.double() - want).abs().max() < 1e-4 * k ** 0.5
            for m in (0, 5, 62, 63):
                assert torch.equal(qblocks.dense(lib, x[m:m + 1], weight, b), y[m:m + 1])
            for rows in (2, 3, 4, 6, 17, 33):
                assert torch.equal(qblocks.dense(lib, x[:rows], weight, b), y[:rows])
                assert torch.equal(qblocks.dense(lib, x[-rows:], weight, b), y[-rows:])
            wide = torch.zeros(64, k + 5)
            wide[:, 2:k + 2] = x
            assert torch.equal(qblocks.dense(lib, wide[:, 2:k + 2], weight, b), y)  # rows k + 5 apart


@pytest.mark.parametrize("hd,nq,nkv", [(64, 9, 3), (256, 4, 1), (80, 6, 2), (24, 2, 1)])
def test_a_rows_attention_over_a_long_cache_agrees_with_float64(hd, nq, nkv):
    """ro_attend (one decode row) against softmax attention in float64: keys in blocks of 16
    with a tail (S = 16, 17, 40, 333), a window's first key not a block's; head sizes that
    take the 16-lane path (64, 256, 80: 4, 16 and 5 vectors) and one that does not (24)."""
    gen = torch.Generator().manual_seed(11)
    for S, first in ((1, 0), (16, 0), (17, 0), (40, 3), (333, 0), (333, 150)):
        cap = S + 2
        kc, vc = torch.randn(nkv, cap, hd, generator=gen) * 2, torch.randn(nkv, cap, hd, generator=gen)
        q, k, v = (torch.randn(n * hd, generator=gen) for n in (nq, nkv, nkv))
        cos, sin = torch.ones(hd), torch.zeros(hd)  # rope at angle 0: q and k as given
        out, pos = torch.empty(nq * hd), S - 1
        assert LIB.ro_attend(nq, nkv, hd, q.data_ptr(), 0, k.data_ptr(), 0, v.data_ptr(), 0, None, None, 1e-6,
                             cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), cap, pos, first,
                             hd ** -0.5, out.data_ptr(), 0) == 0
        assert torch.equal(kc[:, pos], k.view(nkv, hd)) and torch.equal(vc[:, pos], v.view(nkv, hd))
        keys, values = kc[:, first:pos + 1].double(), vc[:, first:pos + 1].double()  # [nkv, S', hd]
        qh = q.double().view(nkv, nq // nkv, hd)
        p = torch.softmax(qh @ keys.transpose(1, 2) * hd ** -0.5, dim=-1)
        want = (p @ values).reshape(-1)
        assert (out.double() - want).abs().max() < 1e-5, (S, first)


def test_a_decode_row_past_the_window_sees_only_the_window():
    """Gemma's sliding layer: keys older than the window are not attended to."""
    stage = _stage("gemma3", "float")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 64, generator=gen)
    cache = stage.new_caches()
    _forward(stage, LIB, x, [(0, 12, cache)])
    block = stage.layers["0"]  # sliding, window 5
    row = torch.randn(1, 64, generator=gen)
    cos, sin = rope_tables(stage.config, True, [(12, 1)], row.device, row.dtype)
    with torch.inference_mode():
        want = block(row, cos, sin, [(12, 1, copy.deepcopy(cache[0]))])
        c = copy.deepcopy(cache[0])
        c.k[:, :8] = 1e3  # positions 0..7 are outside the window of position 12
        got = rowops.block(LIB, block, row.clone(), cos, sin, [(12, 1, c)])
    assert ((want - got).abs().max() / want.abs().max()).item() < 1e-5


def test_without_a_compiler_the_torch_forward_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("MESHD_KERNEL_CACHE", str(tmp_path))
    assert rowops.library_for(torch.device("cpu"), torch.float32) is None
    monkeypatch.delenv("CC")
    assert rowops.library_for(torch.device("cpu"), torch.bfloat16) is None
    assert rowops.library_for(torch.device("meta"), torch.float32) is None


def test_the_c_structs_and_the_python_structures_are_one_layout(monkeypatch, tmp_path):
    """A block's plan is rowops.c's ro_plan / ro_linear / ro_segment, which rowops.py fills as
    ctypes Structures: where the two sides differ (a field added in C only), the library is
    refused and the step-by-step path runs, instead of ro_block reading fields at the wrong
    offsets."""
    assert rowops.c_layout(LIB) == rowops.layout()
    changed = tmp_path / "rowops.c"
    source = rowops.SOURCE.read_text()
    assert "    int64_t n_qkv, n_gate_up;" in source
    changed.write_text(source.replace("    int64_t n_qkv, n_gate_up;", "    int64_t n_qkv, n_gate_up, added;", 1))
    monkeypatch.setenv("MESHD_KERNEL_CACHE", str(tmp_path / "kernels"))
    built = qblocks.build(changed)
    assert built is not None
    assert rowops._declared(built) is None


needs_blocks = pytest.mark.skipif(qblocks.library() is None, reason="no C compiler to build shards/qblocks.c")


def _whole(stage: Stage, on: bool) -> None:
    """Decode rows as whole blocks in C, or step by step (``Kernels.ROWS``, as load_stage sets it)."""
    stage.whole_block = on


@needs_blocks
@pytest.mark.parametrize("weights", list(BLOCKS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_rows_as_a_whole_block_give_the_step_by_step_bits(name, weights):
    stage = _stage(name, weights)
    paths = {m.path for m in stage.modules() if isinstance(m, qlinear.QuantLinear)}
    assert paths == ({"blocks_cpu"} if weights == "blocks" else {"blocks_cpu", "int4pack_cpu"})
    _whole(stage, True)
    plans = [rowops._plan(b).whole for b in stage.layers.values()]
    assert all(p is not None for p in plans)
    assert [r[0] for r in plans[0].runs] == RUNS[weights]
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randn(n, 64, generator=gen) for n in (9, 3, 6)]
    steps = torch.randn(4, 3, 64, generator=gen)  # four decode steps of the three sessions
    runs = {}
    for on in (False, True):
        _whole(stage, on)
        caches = [stage.new_caches() for _ in prompts]
        for pr, c in zip(prompts, caches):
            _forward(stage, LIB, pr, [(0, len(pr), c)])
        outs = []
        for i, rows in enumerate(steps):  # all three in one batch, then the first and the last alone
            batch = [(len(pr) + i, 1, c) for pr, c in zip(prompts, caches)]
            if i % 2:
                outs += [_forward(stage, LIB, rows[j:j + 1], batch[j:j + 1]) for j in range(3)]
            else:
                outs.append(_forward(stage, LIB, rows, batch))
        runs[on] = outs, caches
    (want, want_c), (got, got_c) = runs[False], runs[True]
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for wc, gc in zip(want_c, got_c):
        for layer in wc:
            n = wc[layer].length
            assert gc[layer].length == n
            assert torch.equal(wc[layer].k[:, :n], gc[layer].k[:, :n])
            assert torch.equal(wc[layer].v[:, :n], gc[layer].v[:, :n])


@needs_blocks
def test_a_whole_block_row_equals_that_row_in_a_mixed_batch():
    """A decode row alone runs ro_block; beside a prompt's chunk it runs step by step."""
    stage = _stage("gemma3", "blocks+int4 qkv w2")
    _whole(stage, True)
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(7, 64, generator=gen)
    ca = stage.new_caches()
    _forward(stage, LIB, a, [(0, 7, ca)])
    step, chunk = torch.randn(1, 64, generator=gen), torch.randn(3, 64, generator=gen)
    alone = _forward(stage, LIB, step, [(7, 1, copy.deepcopy(ca))])
    mixed = _forward(stage, LIB, torch.cat([chunk, step]), [(0, 3, stage.new_caches()), (7, 1, ca)])
    assert torch.equal(mixed[3:], alone)
