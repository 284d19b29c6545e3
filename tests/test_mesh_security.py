"""Who gets into a mesh, and what a link does with frames it should not act on.

On the bridge of ``tiny_mesh``: a daemon holding the wrong secret and one of another
mesh name (both advertising more VRAM than anyone, so that letting either in would
change the supernode) stay out. Then pytest itself completes the real handshake as
a fake peer with the right secret, and sends a ForwardBatch of a stale term (answered by
Fail, logged, nothing run) and then bytes that are no frame at all (that link alone
is closed, code 4002). The mesh serves the same tokens throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time

import aiohttp
import pytest
import torch

from meshd.errors import ProtocolError
from meshd.control.peers import CLOSE_PROTOCOL
from protocol.codec import decode
from protocol.messages import (
    Fail,
    ForwardBatch,
    ResultBatch,
    Segment,
    SessionId,
)
from shards.manifest import Manifest
from shards.wire import to_wire
from tests.fixtures.mesh import GiB, MAX_TOKENS, PROMPT
from tests.meshlab import complete
from tests.sealed import sealed_peer

pytestmark = [pytest.mark.netns, pytest.mark.xdist_group("tiny_mesh")]  # one four-daemon mesh for all three

WATCH_S = 4.0  # how long, after the refusals are logged, the views must stay clean


def assert_views_clean(tiny_mesh, outsiders: set[str], term: int) -> None:
    for d in tiny_mesh.daemons:
        v = d.status()
        assert v is not None, tiny_mesh.mesh.fail_report([d])
        seen = {p["id"] for p in v["peers"]} | {a["node"] for a in v["plan"]}
        assert not seen & outsiders, f"{d.name} lets in {seen & outsiders}" + tiny_mesh.mesh.fail_report()
        assert v["supernode"] == tiny_mesh.daemons[0].node_id and v["term"] == term, \
            f"{d.name}: supernode {v['supernode']} term {v['term']}" + tiny_mesh.mesh.fail_report()


def test_wrong_secret_and_other_mesh_stay_out(tiny_mesh):
    mesh, members = tiny_mesh.mesh, tiny_mesh.daemons
    term = members[0].status()["term"]
    wrong_secret = mesh.new_secret("wrong-secret")
    h_secret, h_mesh = tiny_mesh.lab.add_host(), tiny_mesh.lab.add_host()
    intruders = [
        mesh.start(h_secret, name="intruder-secret", model=str(tiny_mesh.model_dir), vram=64 * GiB,
                   secret_file=wrong_secret),
        mesh.start(h_mesh, name="intruder-mesh", model=str(tiny_mesh.model_dir), vram=64 * GiB, mesh="other"),
    ]
    try:
        # Until every member has refused the wrong secret (each pair meets once the
        # adverts are in), the views are watched the whole time.
        refused: dict[str, dict] = {}
        deadline = time.monotonic() + 90.0
        while len(refused) < len(members) and time.monotonic() < deadline:
            mesh._check_running(intruders)
            for d in members:
                for rec in d.log_events("peer_refused"):
                    if str(rec.get("addr", "")).split(":")[0] == h_secret.addr:
                        refused.setdefault(d.name, rec)
            outsiders = {i.node_id for i in intruders}
            assert_views_clean(tiny_mesh, outsiders, term)
            time.sleep(0.25)
        assert len(refused) == len(members), \
            f"only {sorted(refused)} logged peer_refused for {h_secret.addr}" + mesh.fail_report()
        assert all("secret" in r.get("reason", "") for r in refused.values()), refused
        watch_until = time.monotonic() + WATCH_S
        for _ in range(int(WATCH_S / 0.25) + 1):
            assert_views_clean(tiny_mesh, {i.node_id for i in intruders}, term)
            if time.monotonic() > watch_until:
                break
            time.sleep(0.25)
        # The other mesh's advert reached the members, and was ignored there.
        assert any("'other'" in r.get("why", "") for r in members[1].log_events("mdns_ignored")), \
            mesh.fail_report([members[1]])
        # The intruders see nobody either.
        for i in intruders:
            v = i.status()
            assert v is not None and {p["id"] for p in v["peers"]} == {i.node_id}, (i.name, v)
        got, _ = complete(members[2].url, PROMPT, MAX_TOKENS)
        assert got == tiny_mesh.reference, mesh.fail_report()
    finally:
        for i in intruders:
            i.terminate(timeout=5)


# -- a fake peer with the right secret ----------------------------------------------------


@contextlib.asynccontextmanager
async def fake_peer(url: str, secret: bytes, mesh: str):
    """pytest as a member: the real handshake, then frames by hand. Advertises nothing
    (no VRAM, no budget): it must not win the election or be given layers."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with sealed_peer(http, url, secret, mesh=mesh) as peer:
            yield peer


async def reply_to(peer, req: int):
    return await peer.next((Fail, ResultBatch), where=lambda m: m.req == req)


def stage_peer(tiny_mesh):
    view = tiny_mesh.daemons[0].status()
    sn = view["supernode"]
    d = next(d for d in tiny_mesh.daemons[1:] if any(a["node"] == d.node_id for a in view["plan"]))
    assert d.node_id != sn
    return d, view


async def test_stale_term_forward_is_dropped_and_malformed_frame_closes_only_that_link(tiny_mesh):
    mesh = tiny_mesh.mesh
    target, view = stage_peer(tiny_mesh)
    term = view["term"]
    secret = mesh.secret_file.read_bytes().strip()
    hidden = Manifest.load(tiny_mesh.model_dir).config.hidden_size
    before = len(target.log_events("stale_frame_dropped"))

    async with fake_peer(target.url, secret, "lab") as peer:
        ids = {p["id"] for p in (await asyncio.to_thread(target.status))["peers"]}
        assert peer.me.node_id in ids, "the handshake with the right secret should have made a link"
        # The frame the pipeline sends (a decode row) of term 0 and of the term before
        # this one: both for a session nobody has.
        session = SessionId("made-up-" + secrets.token_hex(4))
        frames = [ForwardBatch(0, 1, (Segment(session, 0, 1),), to_wire(torch.randn(1, hidden))),
                  ForwardBatch(max(0, term - 1), 2, (Segment(session, 5, 1),), to_wire(torch.randn(1, hidden)))]
        stale_terms = sorted(f.term for f in frames)
        for frame in frames:
            await peer.send(frame)
            reply = await reply_to(peer, frame.req)
            assert isinstance(reply, Fail), \
                f"a term-{frame.term} {type(frame).__name__} was run: {reply!r}" + mesh.fail_report([target])
        deadline = time.monotonic() + 10
        while len(target.log_events("stale_frame_dropped")) - before < len(stale_terms) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        dropped = target.log_events("stale_frame_dropped")[before:]
        assert sorted(r.get("term") for r in dropped) == stale_terms, dropped

    got, _ = await asyncio.to_thread(complete, tiny_mesh.daemons[2].url, PROMPT, MAX_TOKENS)
    assert got == tiny_mesh.reference, mesh.fail_report()

    junk = random.Random(4002).randbytes(96)
    with pytest.raises(ProtocolError):
        decode(junk)  # it really is no frame
    async with fake_peer(target.url, secret, "lab") as peer:
        await peer.send_raw(junk)  # sealed: it opens, and is no frame
        code = await peer.closed()
        assert code == CLOSE_PROTOCOL, f"link closed with {code}" + mesh.fail_report([target])
    assert target.log_events("link_protocol_error"), mesh.fail_report([target])

    # Only that link went: the mesh's own links, term and plan are as they were.
    views = [await asyncio.to_thread(d.status) for d in tiny_mesh.daemons]
    for d, v in zip(tiny_mesh.daemons, views):
        assert v["serving"] and v["term"] == term and v["plan"] == view["plan"], (d.name, v)
        live = {p["id"] for p in v["peers"] if p["state"] != "lost"}
        assert live == {x.node_id for x in tiny_mesh.daemons}, (d.name, live)
    got, _ = await asyncio.to_thread(complete, tiny_mesh.daemons[2].url, PROMPT, MAX_TOKENS)
    assert got == tiny_mesh.reference, mesh.fail_report()
