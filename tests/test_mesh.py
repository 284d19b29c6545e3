"""The mesh as a user runs it: real ``meshd run`` daemons, one per network namespace
on a bridge, found by mDNS, answering completions equal to one node's, token for token.

Most tests share ``tiny_mesh`` (four daemons on the tiny model, booted once); the
static-peer and two-mesh tests build their own lab, and the real model gets one test
of three peers. What is asserted is what a user would see: /status, meshctl's table,
the completions, the files in a state dir.
"""

from __future__ import annotations

import hashlib
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshd.control.placement import validate
from protocol.messages import Assignment
from shards.manifest import MANIFEST_FILE, Manifest
from shards.span import Span
from tests.fixtures.mesh import GiB, LAYER_DELAY_MS, MAX_TOKENS, PROMPT
from tests.meshlab import complete, complete_stream, greedy_reference, plan_spans

pytestmark = [pytest.mark.netns, pytest.mark.xdist_group("tiny_mesh")]  # one four-daemon mesh for all three


def meshctl_argv() -> list[str]:
    script = Path(sys.executable).parent / "meshctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "meshd.tools.meshctl"]


def assignments(view: dict) -> list[Assignment]:
    return [Assignment(a["node"], Span(a["start"], a["stop"])) for a in view["plan"]]


# -- discovery, election, placement -----------------------------------------------------


def test_four_daemons_form_one_mesh_by_mdns(tiny_mesh, record_property):
    mesh, daemons = tiny_mesh.mesh, tiny_mesh.daemons
    report = mesh.fail_report(daemons)
    ids = {d.node_id for d in daemons}
    assert len(ids) == 4 and "" not in ids, report
    assert all("--no-mdns" not in d.argv and "--peer" not in d.argv for d in daemons), "mDNS only"
    biggest = daemons[0]  # started with the highest --advertise-vram
    views = [d.status() for d in daemons]
    assert all(views), report
    for d, v in zip(daemons, views):
        live = {p["id"] for p in v["peers"] if p["state"] != "lost"}
        assert live == ids, f"{d.name} sees {sorted(live)}, not all four {sorted(ids)}" + report
        assert v["supernode"] == biggest.node_id, f"{d.name} holds {v['supernode']} as supernode" + report
        assert v["serving"], f"{d.name} is not serving: {v.get('reason')}" + report
    assert len({v["term"] for v in views}) == 1, [v["term"] for v in views]
    assert len({str(v["plan"]) for v in views}) == 1, [plan_spans(v) for v in views]
    n_layers = Manifest.load(tiny_mesh.model_dir).n_layers
    validate(assignments(views[0]), n_layers)  # every layer once, contiguous, in order
    assert {a["node"] for a in views[0]["plan"]} <= ids

    # meshctl, run inside one namespace against another peer, as an operator on that box would.
    res = daemons[3].host.run(meshctl_argv() + ["status", "--url", daemons[1].url], capture_output=True,
                              text=True, timeout=60)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    rows = {line.split()[0]: line for line in res.stdout.splitlines() if line.split() and line.split()[0] in ids}
    assert set(rows) == ids, f"meshctl's table lacks peers {ids - set(rows)}:\n{res.stdout}"
    assert " supernode " in rows[biggest.node_id] + " ", res.stdout
    assert all(" supernode " not in rows[i] + " " for i in ids - {biggest.node_id}), res.stdout

    took = tiny_mesh.converged["converged_s"]
    record_property("converged_s", took)
    print(f"\n4 daemons by mDNS: start to converged plan {took:.2f} s; plan {plan_spans(views[0])}")


def test_completion_through_a_stage_peer_equals_single_node(tiny_mesh):
    mesh, daemons = tiny_mesh.mesh, tiny_mesh.daemons
    want = tiny_mesh.reference
    assert len(want) == MAX_TOKENS, "the prompt should run the whole length on one node"
    view = daemons[2].status()
    assert view is not None, mesh.fail_report()
    owners = {a["node"] for a in view["plan"]}
    assert len(owners) > 1, f"the plan runs on one peer only: {plan_spans(view)}"
    entry = daemons[2]
    assert entry.node_id != view["supernode"]

    got, data = complete(entry.url, PROMPT, MAX_TOKENS)
    assert got == want, f"mesh {got}\nnode {want}" + mesh.fail_report()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == MAX_TOKENS

    # Streaming, proxied by another stage peer: the same tokens, SSE, ending in [DONE].
    streamed, events = complete_stream(daemons[1].url, PROMPT, MAX_TOKENS)
    assert streamed == want, f"stream {streamed}\nnode   {want}" + mesh.fail_report()
    assert events[-1] == "[DONE]" and len(events) > 2, events[-3:]
    text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    assert text == data["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_peer_without_model_fetches_exactly_its_span(tiny_mesh):
    mesh, fetcher = tiny_mesh.mesh, tiny_mesh.fetcher
    source = Manifest.load(tiny_mesh.model_dir)
    view = fetcher.status()
    assert view is not None, mesh.fail_report([fetcher])
    mine = next((a for a in view["plan"] if a["node"] == fetcher.node_id), None)
    assert mine is not None, f"the peer without files got no span: {plan_spans(view)}"
    span = Span(mine["start"], mine["stop"])

    store = fetcher.state_dir / "models" / source.name
    want = set(source.files_for(span, embed=False)) | {MANIFEST_FILE}
    have = {p.name for p in store.iterdir() if not p.name.startswith(".")}
    assert have == want, f"state dir holds {sorted(have)}, span {span} needs {sorted(want)}" + mesh.fail_report([fetcher])
    assert not [p for p in store.iterdir() if p.name.endswith(".part")], "a partial download was left behind"
    elsewhere = [p for p in fetcher.state_dir.rglob("*.safetensors") if p.parent != store]
    assert not elsewhere, elsewhere
    assert (store / MANIFEST_FILE).read_bytes() == (tiny_mesh.model_dir / MANIFEST_FILE).read_bytes()
    for name in want - {MANIFEST_FILE}:
        digest = hashlib.sha256((store / name).read_bytes()).hexdigest()
        assert digest == source.files[name].sha256, f"{name} does not match the manifest"
    fetched = {r["file"] for r in fetcher.log_events("shard_fetched")}
    assert fetched == want - {MANIFEST_FILE}, fetched

    got, _ = complete(fetcher.url, PROMPT, MAX_TOKENS)
    assert got == tiny_mesh.reference, mesh.fail_report()


# -- the real model -----------------------------------------------------------------------


@pytest.mark.real_model
def test_real_model_on_three_peers_equals_single_node(meshlab, real_model_dir):
    prompt, n = "Once upon a time, in a small village by the sea,", 32
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [meshlab.start(h, model=str(real_model_dir), vram=(3 - i) * GiB) for i, h in enumerate(hosts)]
    view = meshlab.wait_converged(daemons, timeout=180)
    # All three do part of the model: the supernode embeds and projects (layers or not),
    # the layers run on at least two peers.
    owners = {a["node"] for a in view["plan"]}
    assert owners | {view["supernode"]} == {d.node_id for d in daemons} and len(owners) >= 2, plan_spans(view)
    want = greedy_reference(real_model_dir, prompt, n)
    assert len(want) == n, "the prompt should run 32 tokens on one node"
    got, data = complete(daemons[2].url, prompt, n)
    assert got == want, f"mesh {got}\nnode {want}" + meshlab.fail_report()
    print(f"\nreal model, 3 peers: converged in {view['converged_s']:.2f} s, plan {plan_spans(view)}; "
          f"{data['choices'][0]['text']!r}")


# -- static peers, two meshes ---------------------------------------------------------------


def test_static_peers_without_mdns_form_a_mesh(meshlab, tiny_model_dir):
    hosts = [meshlab.lab.add_host() for _ in range(3)]
    daemons = [
        meshlab.start(h, model=str(tiny_model_dir), vram=(3 - i) * GiB, mdns=False, layer_delay_ms=LAYER_DELAY_MS,
                      peers=tuple(f"{o.addr}:8470" for o in hosts if o is not h))
        for i, h in enumerate(hosts)
    ]
    view = meshlab.wait_converged(daemons)
    assert view["supernode"] == daemons[0].node_id
    assert len({a["node"] for a in view["plan"]}) > 1, plan_spans(view)
    for d in daemons:
        assert not d.log_events("mdns_started"), f"{d.name} ran mDNS"
    got, _ = complete(daemons[2].url, PROMPT, MAX_TOKENS)
    assert got == greedy_reference(tiny_model_dir, PROMPT, MAX_TOKENS), meshlab.fail_report()


def test_two_meshes_on_one_bridge_stay_apart_and_both_serve(meshlab, tiny_model_dir):
    hosts = [meshlab.lab.add_host() for _ in range(4)]
    # Interleaved VRAM: were the names ignored, beta's 8 GiB peer would lead everyone.
    alpha = [meshlab.start(hosts[0], model=str(tiny_model_dir), mesh="alpha", vram=4 * GiB),
             meshlab.start(hosts[1], model=str(tiny_model_dir), mesh="alpha", vram=1 * GiB)]
    beta = [meshlab.start(hosts[2], model=str(tiny_model_dir), mesh="beta", vram=8 * GiB),
            meshlab.start(hosts[3], model=str(tiny_model_dir), mesh="beta", vram=2 * GiB)]
    va = meshlab.wait_converged(alpha)
    vb = meshlab.wait_converged(beta)
    assert va["supernode"] == alpha[0].node_id and vb["supernode"] == beta[0].node_id
    ids_a, ids_b = {d.node_id for d in alpha}, {d.node_id for d in beta}
    for d in alpha + beta:
        seen = {p["id"] for p in d.status()["peers"]} | {a["node"] for a in d.status()["plan"]}
        other = ids_b if d in alpha else ids_a
        assert not seen & other, f"{d.name} lists peers of the other mesh: {seen & other}"
    # Each saw the other mesh's adverts and ignored them (so the test meant something).
    assert any("is not ours" in r.get("why", "") for r in alpha[0].log_events("mdns_ignored")), \
        meshlab.fail_report(alpha[:1])

    want = greedy_reference(tiny_model_dir, PROMPT, MAX_TOKENS)
    with ThreadPoolExecutor(2) as pool:  # at the same time, through each mesh's stage peer
        fa = pool.submit(complete, alpha[1].url, PROMPT, MAX_TOKENS)
        fb = pool.submit(complete, beta[1].url, PROMPT, MAX_TOKENS)
        got_a, got_b = fa.result()[0], fb.result()[0]
    assert got_a == want and got_b == want, meshlab.fail_report()
    # Neither mesh re-planned because of the other.
    assert alpha[1].status()["term"] == va["term"] and beta[1].status()["term"] == vb["term"]
