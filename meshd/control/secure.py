"""What keeps a peer link private and honest: a Noise handshake over the mesh
secret, then every frame sealed.

Handshake: ``Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`` (the Noise Protocol Framework,
rev. 34, via the ``noiseprotocol`` package on ``cryptography``'s primitives), with
a pre-shared key derived from the mesh secret and a prologue that names the
protocol version and the mesh. The dialer is the initiator:

    -> psk, e                 (32 bytes + a tag: only a holder of the secret can make it)
    <- e, ee  + Hello(B)      (encrypted to keys from both fresh ephemerals and the psk)
    -> sealed Hello(A)        (the first transport message: key confirmation, as WireGuard's)

Neither side sends anything that a stranger could read or use before the other
has proved the secret on this connection: the responder answers only a first
message made with the psk, and its answer can be read only by whoever made that
message's ephemeral key; the responder takes the link only once the initiator's
first sealed frame opens, which needs both ephemerals' shared secret. A replayed
first message gets an answer nobody can read and then a timeout; a relayed or
reflected one gets nothing either side accepts. The Hellos travel only inside
the handshake, so a stranger does not even learn a peer's name or capabilities.

Transport: every frame is cut into pieces of at most ``CHUNK`` bytes, each one
Noise transport message (ChaCha20-Poly1305 under a per-direction key with a
64-bit nonce counter): a piece replayed, reordered, altered or injected fails to
open and is dropped (the counter does not move, so the real stream goes on); a
link never acts on a byte that did not open. Because every WebSocket message is
one piece, the socket's ``max_msg_size`` is ``WIRE_MAX`` (about 16 KiB) before
and after the handshake: a stranger cannot make a peer buffer more than that.

``--debug-plaintext-links`` (both ends alike, checked in the Hellos) keeps the
authenticated handshake but sends frames in clear, for packet captures while
debugging; never on a network you do not own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from aiohttp import WSMsgType, web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from noise.connection import NoiseConnection
from noise.exceptions import NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError

from meshd.errors import AuthError, ProtocolError
from protocol.codec import decode, encode
from protocol.messages import PROTOCOL_VERSION, Capabilities, Hello, NodeId

NOISE_PROTOCOL = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
HANDSHAKE_TIMEOUT_S = 5.0  # the whole handshake, from the socket's upgrade
CHUNK = 16 * 1024  # frame bytes per sealed piece
_TAG = 16  # Poly1305
_LAST, _MORE = 1, 0  # a piece's first (sealed) byte: does the frame end here
CLOSE_AUTH = 4001  # the WebSocket close code of a refused handshake
WIRE_MAX = CHUNK + 64  # every peer socket's max_msg_size (a piece is CHUNK + 17), before authentication too

WS = web.WebSocketResponse | aiohttp.ClientWebSocketResponse


class SelfLink(AuthError):
    """The address dialed is this peer itself (a static peer list that names us)."""


class Forged(ProtocolError):
    """A piece that does not open under the link's key: dropped, never acted on."""


def _kdf(secret: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"meshd " + purpose).derive(secret)


def mesh_psk(secret: bytes) -> bytes:
    """The Noise pre-shared key: the mesh secret through HKDF (any length in, 32 bytes out)."""
    return _kdf(secret, b"noise psk v1")


def files_key(secret: bytes) -> bytes:
    """The key of the shard-file request MACs (kept apart from the Noise key)."""
    return _kdf(secret, b"files mac v2")


def prologue(mesh: str) -> bytes:
    return b"meshd|%d|" % PROTOCOL_VERSION + mesh.encode()


@dataclass(frozen=True, slots=True)
class LocalIdentity:
    node_id: NodeId
    name: str
    mesh: str
    secret: bytes
    plaintext: bool = False  # --debug-plaintext-links

    def hello(self, caps: Capabilities) -> Hello:
        return Hello(PROTOCOL_VERSION, self.node_id, self.mesh, self.name, caps, int(self.plaintext))

    def noise(self, initiator: bool) -> NoiseConnection:
        conn = NoiseConnection.from_name(NOISE_PROTOCOL)
        conn.set_psks(psk=mesh_psk(self.secret))
        conn.set_prologue(prologue(self.mesh))
        if initiator:
            conn.set_as_initiator()
        else:
            conn.set_as_responder()
        conn.start_handshake()
        return conn


class Channel:
    """One link's sealing and opening of frames (its two Noise cipher states)."""

    def __init__(self, noise: NoiseConnection, plaintext: bool, max_frame: int):
        self._noise = noise
        self.plaintext = plaintext
        self.max_frame = max_frame
        self._parts: list[bytes] = []
        self._size = 0
        self.forged = 0  # pieces dropped because they did not open

    def seal(self, frame: bytes) -> list[bytes]:
        """The WebSocket messages that carry ``frame``, in order (under the link's send lock)."""
        view = memoryview(frame)
        pieces = []
        for off in range(0, max(len(view), 1), CHUNK):
            flag = _LAST if off + CHUNK >= len(view) else _MORE
            piece = bytes((flag,)) + view[off:off + CHUNK]
            pieces.append(piece if self.plaintext else self._noise.encrypt(piece))
        return pieces

    def open(self, piece: bytes) -> bytes | None:
        """The whole frame once its last piece is in, else None; ``Forged`` for a piece
        that does not open (the caller drops it), ``ProtocolError`` for one that opens
        but breaks the framing (the peer itself is wrong)."""
        if not self.plaintext:
            try:
                piece = self._noise.decrypt(piece)
            except NoiseInvalidMessage:
                self.forged += 1
                raise Forged("a piece that does not open under this link's key") from None
        if not piece or piece[0] not in (_LAST, _MORE):
            raise ProtocolError("a piece without its framing byte")
        self._size += len(piece) - 1
        if self._size > self.max_frame:
            raise ProtocolError(f"frame exceeds the {self.max_frame}-byte limit")
        self._parts.append(piece[1:])
        if piece[0] == _MORE:
            return None
        frame = b"".join(self._parts)
        self._parts, self._size = [], 0
        return frame


async def _receive(ws: WS) -> bytes:
    msg = await ws.receive()
    if msg.type == WSMsgType.BINARY:
        return msg.data
    if msg.type == WSMsgType.CLOSE and ws.close_code == CLOSE_AUTH:
        raise AuthError(f"the peer refused the handshake: {msg.extra or 'no reason given'}")
    if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
        raise ConnectionError(f"closed during the handshake ({ws.close_code})")
    if msg.type == WSMsgType.ERROR:
        raise ProtocolError(f"handshake frame refused: {ws.exception()}")
    raise ProtocolError(f"expected a binary frame during the handshake, got {msg.type.name}")


_UNREADABLE = (InvalidTag, NoiseInvalidMessage, NoiseValueError, NoiseHandshakeError, ValueError)
_WRONG_SECRET = "authentication failed: wrong mesh secret (or another mesh name or protocol version)"


def _their_hello(data: bytes, me: LocalIdentity, expect: NodeId | None) -> Hello:
    hello = decode(data, max_size=CHUNK)
    if not isinstance(hello, Hello):
        raise ProtocolError(f"expected Hello, got {type(hello).__name__}")
    if hello.version != PROTOCOL_VERSION or hello.mesh != me.mesh:  # the prologue bound both already
        raise AuthError(f"peer speaks version {hello.version} of mesh {hello.mesh!r}")
    if hello.node_id == me.node_id:
        raise SelfLink("a link to ourselves")
    if expect is not None and hello.node_id != expect:
        raise AuthError(f"dialed {expect} but {hello.node_id} answered (a relay?)")
    if bool(hello.plaintext) != me.plaintext:
        raise AuthError("one side runs --debug-plaintext-links and the other does not")
    return hello


async def handshake(ws: WS, me: LocalIdentity, caps: Capabilities, *, initiator: bool,
                    max_frame: int, expect: NodeId | None = None) -> tuple[Hello, Channel]:
    """Both halves of the handshake: the peer's Hello, and the link's channel.
    ``expect``: the node id the dialer was told is at this address (mDNS), if any."""
    noise = me.noise(initiator)
    mine = encode(me.hello(caps))
    if len(mine) > CHUNK:
        raise ProtocolError(f"our Hello is {len(mine)} bytes, over the {CHUNK}-byte handshake limit")
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            if initiator:
                await ws.send_bytes(bytes(noise.write_message(b"")))
                reply = await _receive(ws)
                try:
                    payload = bytes(noise.read_message(reply))
                except _UNREADABLE:
                    raise AuthError(_WRONG_SECRET) from None
                theirs = _their_hello(payload, me, expect)
                channel = Channel(noise, plaintext=False, max_frame=CHUNK)
                (confirm,) = channel.seal(mine)  # always sealed: it proves the keys
                await ws.send_bytes(confirm)
            else:
                first = await _receive(ws)
                try:
                    if noise.read_message(first):
                        raise ProtocolError("the first handshake message carries no payload")
                except _UNREADABLE:
                    raise AuthError(_WRONG_SECRET) from None
                await ws.send_bytes(bytes(noise.write_message(mine)))
                channel = Channel(noise, plaintext=False, max_frame=CHUNK)
                try:
                    confirming = channel.open(await _receive(ws))
                except Forged:
                    raise AuthError(_WRONG_SECRET) from None
                if confirming is None:
                    raise ProtocolError("the confirming Hello must be one piece")
                theirs = _their_hello(confirming, me, None)
    except TimeoutError:
        raise AuthError(f"handshake not done within {HANDSHAKE_TIMEOUT_S:g} s") from None
    channel.plaintext = me.plaintext
    channel.max_frame = max_frame
    return theirs, channel
