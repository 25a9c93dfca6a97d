"""Objects sealed and opened as streams: the same format as whole-object sealing, whatever the
pieces' sizes, and refused when torn, altered, moved to another key or opened with another
key."""

from __future__ import annotations

import io
import os

import pytest

from fleetline.errors import IntegrityError
from fleetline.storage.crypto import OVERHEAD, ObjectCipher

KEY = bytes(range(32))
DATA = os.urandom(100_003)


def sealed_by_stream(cipher: ObjectCipher, key: str, data: bytes, read_size: int) -> bytes:
    sealing = cipher.sealing(key, io.BytesIO(data))
    out = bytearray()
    while piece := sealing.read(read_size):
        assert len(piece) <= read_size
        out += piece
    assert sealing.length == len(out) == len(data) + OVERHEAD
    return bytes(out)


def opened_by_stream(cipher: ObjectCipher, key: str, blob: bytes, piece_size: int) -> bytes:
    out = bytearray()
    opening = cipher.opening(key, out.extend)
    for at in range(0, len(blob), piece_size):
        opening.feed(memoryview(blob)[at : at + piece_size])
    opening.close()
    return bytes(out)


@pytest.mark.parametrize("read_size", [1, 7, 16, 4096, 10**6])
def test_a_streamed_seal_opens_whole_and_a_whole_seal_opens_streamed(read_size: int) -> None:
    cipher = ObjectCipher(KEY)
    streamed = sealed_by_stream(cipher, "ckpt/a.bin", DATA, read_size)
    assert cipher.open("ckpt/a.bin", streamed) == DATA
    whole = cipher.seal("ckpt/a.bin", DATA)
    for piece_size in (1, 5, 16, 17, 65_536, len(whole)):
        assert opened_by_stream(cipher, "ckpt/a.bin", whole, piece_size) == DATA
    assert opened_by_stream(cipher, "e", cipher.seal("e", b""), 3) == b""


def test_a_streamed_open_refuses_what_is_altered_torn_moved_or_under_another_key() -> None:
    cipher = ObjectCipher(KEY)
    blob = cipher.seal("ckpt/a.bin", DATA)
    flipped = bytearray(blob)
    flipped[500] ^= 1
    cases = {
        "altered": ("ckpt/a.bin", bytes(flipped), cipher),
        "torn": ("ckpt/a.bin", blob[:-1], cipher),
        "moved to another key": ("ckpt/b.bin", blob, cipher),
        "another key": ("ckpt/a.bin", blob, ObjectCipher(bytes(32))),
    }
    for key, data, opener in cases.values():
        with pytest.raises(IntegrityError, match="decryption failed"):
            opened_by_stream(opener, key, data, 4096)
    for short in (b"", blob[:10], b"FLC1" + bytes(20)):
        with pytest.raises(IntegrityError, match="not an encrypted fleetline object"):
            opened_by_stream(cipher, "ckpt/a.bin", short, 4096)
    with pytest.raises(IntegrityError, match="not an encrypted fleetline object"):
        opened_by_stream(cipher, "ckpt/a.bin", b"PLAIN" + DATA, 4096)
