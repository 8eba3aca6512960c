"""A Handoff V2 producer written for the tests from INTEROP PART C and its errata alone.

It shares no code with kvpack's protocol modules (no Sender, no manifest, frame or schedule
code): frames (C.2-C.3), the begin manifest (C.4), descriptors (C.5), the seal and its HMAC
(C.6, errata M2), canonical JSON (C.7), the span schedule (C.12) and the packed tile layout
(C.13, errata L6) are built here with ``json``, ``struct``, ``hashlib``, ``hmac`` and
``ssl``, so a receiver that accepts it accepts the spec, not itself. Knobs let a test break
exactly one thing: a flipped payload byte, a wrong HMAC key, any generation, another
certificate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Callable, Optional

MAGIC = b"KVPKV2\0\0"
ALPN = "muser-kvpack-v2"
PROTOCOL = "kvpack-live-handoff-v2"
WIDTH = {"f16_le": 2, "f32_le": 4}


def canonical(value) -> bytes:
    """C.7: sorted keys, compact separators, non-ASCII raw (errata L2)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def frame(header: dict, payload: bytes = b"") -> bytes:
    """C.2: magic, u32 LE header length, u64 LE payload length, header JSON, payload."""
    h = canonical(header)
    return MAGIC + struct.pack("<IQ", len(h), len(payload)) + h + payload


@dataclass(frozen=True)
class Geometry:
    """C.12 constants; the defaults are Muse's."""

    nope_layers: tuple[int, ...] = tuple(range(3, 52, 4))
    swa_layers: tuple[int, ...] = tuple(layer for layer in range(52) if layer % 4 != 3)
    window: int = 2048
    tile: int = 512
    group: int = 13
    plane_elements: int = 256  # 2 KV heads x 128
    element_type: str = "f16_le"

    def schedule(self, position: int, cut: int = 0) -> list[tuple[str, Optional[int], int, int, tuple[int, ...]]]:
        """(role, layer label, start, count, packed layers) in wire order (C.12 pseudo-code)."""
        swa_start = max(cut, position - self.window)
        tiles = [(s, min(self.tile, position - s)) for s in range(cut, position, self.tile)]
        out = []
        for g in range(0, len(self.swa_layers), self.group):
            group = self.swa_layers[g : g + self.group]
            for s, n in tiles:
                if s + n <= swa_start:
                    continue
                cs = max(s, swa_start)
                out.append(("swa_tile", group[0], cs, s + n - cs, group))
        for s, n in tiles:
            out.append(("nope_tile", None, s, n, self.nope_layers))
        return out


MUSE = Geometry()


@dataclass
class TlsIdentity:
    """The producer's certificate and key, the CA it trusts, the receiver's SAN and pin."""

    cert: str
    key: str
    ca: str
    server_name: str
    receiver_pin: str


def load_key(path: str) -> bytes:
    """C.10 / errata M7 (the Rust rule): 32 raw bytes, or 64 lowercase hex + trailing CR/LF."""
    with open(path, "rb") as fh:
        raw = fh.read()
    if len(raw) == 32:
        return raw
    text = raw.decode().rstrip("\r\n")
    assert len(text) == 64 and text == text.lower()
    return bytes.fromhex(text)


def connect(host: str, port: int, tls: TlsIdentity, timeout: float = 60.0) -> ssl.SSLSocket:
    """errata H1: TLS 1.3, the CA as the only anchor, hostname checked, exact ALPN, pin."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols([ALPN])
    raw = socket.create_connection((host, port), timeout=timeout)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    chan = ctx.wrap_socket(raw, server_hostname=tls.server_name)
    assert chan.selected_alpn_protocol() == ALPN
    der = chan.getpeercert(binary_form=True)
    assert der is not None and hashlib.sha256(der).hexdigest() == tls.receiver_pin, "receiver leaf is not the pinned one"
    return chan


def build_segments(geo: Geometry, position: int, cut: int, rows: Callable[[int, str, int, int], bytes]) -> list[tuple[dict, bytes]]:
    """(descriptor, payload) per scheduled segment; a tile packs, per layer of its group in
    order, the K plane then the V plane of its rows, token-major (C.13, errata L6)."""
    out = []
    for seq, (role, layer, start, count, layers) in enumerate(geo.schedule(position, cut)):
        payload = b"".join(rows(layer_i, r, start, start + count) for layer_i in layers for r in ("k", "v"))
        ept = geo.plane_elements * 2 * len(layers)
        desc = {
            "sequence": seq,
            "component_id": "target",
            "role": role,
            "layer": layer,
            "logical_start": start,
            "logical_count": count,
            "element_type": geo.element_type,
            "elements_per_token": ept,
            "byte_len": count * ept * WIDTH[geo.element_type],
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        assert len(payload) == desc["byte_len"]
        out.append((desc, payload))
    return out


def begin_manifest(
    transfer_id: str, generation: int, identity: dict, target: str, prompt: list[int], key_id: str, epoch: int, descriptors: Optional[list[dict]]
) -> dict:
    """C.4: the typed field set; deferred mode when ``descriptors`` is None."""
    now = int(time.time() * 1000)
    m = {
        "protocol": PROTOCOL,
        "transfer_id": transfer_id,
        "generation": generation,
        "created_unix_ms": now,
        "expires_unix_ms": now + 900_000,
        "identity": identity,
        "prompt_token_ids": prompt,
        "multimodal": None,
        "hmac": {"key_id": key_id, "epoch": epoch},
        "components": [{"id": "target", "kind": "target_kv", "required": True, "identity_sha256": target}],
        "segments": descriptors if descriptors is not None else [],
    }
    if descriptors is None:
        m["deferred_segments"] = True  # omitted when false (C.4)
    return m


def seal(key: bytes, manifest: dict, descriptors: list[dict], payloads: list[bytes]) -> dict:
    """C.6 + errata M2: begin hash without prefix_cut, plain concatenations, HMAC without a
    domain tag over the canonical core."""
    hashed_begin = {k: v for k, v in manifest.items() if k != "prefix_cut"}
    core = {
        "transfer_id": manifest["transfer_id"],
        "generation": manifest["generation"],
        "begin_sha256": hashlib.sha256(canonical(hashed_begin)).hexdigest(),
        "descriptor_sha256": hashlib.sha256(b"".join(canonical(d) for d in descriptors)).hexdigest(),
        "payload_sha256": hashlib.sha256(b"".join(payloads)).hexdigest(),
        "segment_count": len(descriptors),
        "total_bytes": sum(len(p) for p in payloads),
    }
    return {"core": core, "hmac_sha256": hmac.new(key, canonical(core), hashlib.sha256).hexdigest()}


def read_frame(chan: ssl.SSLSocket) -> tuple[dict, bytes]:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = chan.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("receiver closed the stream")
            buf += chunk
        return buf

    pre = exact(20)
    assert pre[:8] == MAGIC
    hlen, plen = struct.unpack("<IQ", pre[8:])
    return json.loads(exact(hlen)), exact(plen)


def send_transfer(
    host: str,
    port: int,
    tls: TlsIdentity,
    *,
    key: bytes,
    key_id: str,
    epoch: int,
    identity: dict,
    target: str,
    prompt: list[int],
    rows: Callable[[int, str, int, int], bytes],
    generation: int,
    transfer_id: Optional[str] = None,
    deferred: bool = True,
    geometry: Geometry = MUSE,
    flip_payload_byte: Optional[tuple[int, int]] = None,
) -> dict:
    """One transfer of ``prompt`` (the cached prefix: the prompt minus its boundary token).

    Returns ``{"ack": header or None, "error": text or None, "payload_bytes", "segments"}``;
    a receiver that drops the stream (every refusal) gives ``ack`` None.
    """
    segs = build_segments(geometry, len(prompt), 0, rows)
    descriptors = [d for d, _ in segs]
    payloads = [p for _, p in segs]
    tid = transfer_id or hashlib.sha256(f"{generation}-{time.time_ns()}".encode()).hexdigest()  # the producer's default: 64 hex
    manifest = begin_manifest(tid, generation, identity, target, prompt, key_id, epoch, None if deferred else descriptors)
    sealed = seal(key, manifest, descriptors, payloads)
    wire = list(payloads)
    if flip_payload_byte is not None:  # after hashing: the descriptor no longer matches
        i, offset = flip_payload_byte
        b = bytearray(wire[i])
        b[offset] ^= 0x01
        wire[i] = bytes(b)
    result: dict = {"ack": None, "error": None, "payload_bytes": sum(len(p) for p in payloads), "segments": len(segs), "transfer_id": tid}
    try:
        chan = connect(host, port, tls)
    except (ConnectionError, OSError, ssl.SSLError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    try:
        chan.sendall(frame({"kind": "begin", "manifest": manifest}))
        for (desc, _), payload in zip(segs, wire):
            header = {"kind": "segment", "sequence": desc["sequence"]}
            if deferred:
                header["descriptor"] = desc
            chan.sendall(frame(header, payload))
        chan.sendall(frame({"kind": "seal", "manifest": sealed}))
        header, payload = read_frame(chan)
        assert header == {"kind": "ack", "transfer_id": tid, "generation": generation} and payload == b""
        result["ack"] = header
    except (ConnectionError, OSError, ssl.SSLError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        chan.close()
    return result
