"""A saved head state (--state_dir, core/head_state.h) as whoever can write the state directory
sees it: a safetensors file whose metadata holds a checksum (no secret: anyone recomputes it)
and, on a server with a state secret, a seal ("mac", HMAC-SHA256 under the secret).

forge_weight changes a weight and recomputes the checksum, keeping the seal as it was (a forged
file) or re-sealing it under a secret it is given (a valid file of another run).
"""

import hashlib
import hmac
import json
import pathlib
import struct
from typing import Optional

# What the seal covers after the header's length (core/head_state.cc, Seal).
SEAL_TAG = b"remotehead-head-state-seal\n"


def fnv(data: bytes) -> int:
    """The checksum's hash: FNV-1a over 64-bit little-endian words, then the tail bytes."""
    h, mask = 0xcbf29ce484222325, (1 << 64) - 1
    words = len(data) // 8 * 8
    for (word,) in struct.iter_unpack("<Q", data[:words]):
        h = ((h ^ word) * 0x100000001b3) & mask
    for byte in data[words:]:
        h = ((h ^ byte) * 0x100000001b3) & mask
    return h


def canonical(header: dict) -> bytes:
    """The header as the server dumps it (nlohmann: keys in order, no spaces)."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def read_state(path: pathlib.Path):
    """(header, data) of a state file."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), bytearray(raw[8 + size:])


def write_state(path: pathlib.Path, header: dict, data: bytes,
                secret: Optional[bytes] = None) -> None:
    """Writes `header` and `data` as a state file: sealed under `secret` if given (else the
    header's "mac", if any, is kept as it is), then checksummed as the server does."""
    header = json.loads(json.dumps(header))
    header["__metadata__"].pop("checksum", None)
    if secret is not None:
        header["__metadata__"].pop("mac", None)
        text = canonical(header)
        header["__metadata__"]["mac"] = hmac.new(
            secret, SEAL_TAG + struct.pack("<Q", len(text)) + text + bytes(data),
            hashlib.sha256).hexdigest()
    header["__metadata__"]["checksum"] = f"{fnv(canonical(header)):016x}-{fnv(bytes(data)):016x}"
    text = canonical(header)
    text += b" " * ((8 - len(text) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def forge_weight(path: pathlib.Path, delta: float, secret: Optional[bytes] = None) -> None:
    """Adds `delta` to the first weight of a saved state and recomputes its checksum: the file
    is intact. With `secret` it is re-sealed under it (a valid state whose weights differ, as a
    restored disk of another run would be); without, its seal is kept (forged)."""
    header, data = read_state(path)
    start = header["weight"]["data_offsets"][0]
    struct.pack_into("<f", data, start, struct.unpack_from("<f", data, start)[0] + delta)
    write_state(path, header, data, secret)
