"""Client-side encryption for objects: AES-256-GCM, bound to the object's key.

Used where the S3 server offers no server-side encryption (versitygw's POSIX backend does not):
a blob is `FLC1 || nonce(12) || ciphertext+tag`, with the object key as associated data, so a
ciphertext moved to another key, truncated or altered fails to decrypt. The same format is
written and read whole (`seal`, `open`) or streamed (`sealing`, `opening`: objects larger than
memory, decrypted while they download).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import (
    AEADDecryptionContext,
    Cipher,
    algorithms,
    modes,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fleetline.errors import ConfigError, IntegrityError
from fleetline.storage.objects import ObjectStore, Readable

MAGIC = b"FLC1"
NONCE = 12
TAG = 16
HEADER = len(MAGIC) + NONCE
# What sealing adds to an object's size.
OVERHEAD = HEADER + TAG


class ObjectCipher:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ConfigError("the object encryption key must be 32 bytes (AES-256)")
        self._key = key
        self._aead = AESGCM(key)

    @classmethod
    def from_base64(cls, text: str) -> ObjectCipher:
        try:
            return cls(base64.b64decode(text, validate=True))
        except binascii.Error:
            raise ConfigError("FLEETLINE_OBJECT_ENCRYPTION_KEY is not base64") from None

    def seal(self, object_key: str, data: bytes) -> bytes:
        nonce = os.urandom(NONCE)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, object_key.encode())

    def open(self, object_key: str, blob: bytes) -> bytes:
        if not blob.startswith(MAGIC) or len(blob) < OVERHEAD:
            raise IntegrityError(f"{object_key}: not an encrypted fleetline object")
        # Views, not slices: a slice of a large blob is a copy, and on these machines copying
        # into fresh memory cost three times the decryption itself.
        view = memoryview(blob)
        try:
            return self._aead.decrypt(view[len(MAGIC) : HEADER], view[HEADER:], object_key.encode())
        except InvalidTag:
            raise _altered(object_key) from None

    def sealing(self, object_key: str, source: Readable) -> Sealing:
        """A reader of `source` sealed as it is read (for a streamed upload)."""
        return Sealing(self._key, object_key, source)

    def opening(self, object_key: str, write: Callable[[bytes], object]) -> Opening:
        """What takes a sealed object's bytes as they arrive and writes out its plaintext."""
        return Opening(self._key, object_key, write)


def _altered(object_key: str) -> IntegrityError:
    return IntegrityError(f"{object_key}: decryption failed (wrong key or altered object)")


class Sealing:
    """`source` read as a sealed object: the header, the ciphertext of each piece as it is
    read, the tag once `source` ends; `digest` and `length` are of what was handed out."""

    def __init__(self, key: bytes, object_key: str, source: Readable) -> None:
        nonce = os.urandom(NONCE)
        self._encryptor = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._encryptor.authenticate_additional_data(object_key.encode())
        self._source = source
        self._owed = MAGIC + nonce  # handed out before anything more is read
        self._ended = False
        self.digest = hashlib.sha256()
        self.length = 0

    def read(self, size: int = -1) -> bytes:
        pieces, have = [self._owed], len(self._owed)
        while (size < 0 or have < size) and not self._ended:
            data = self._source.read(size - have if size >= 0 else -1)
            if data:
                pieces.append(self._encryptor.update(data))
            else:
                pieces.append(self._encryptor.finalize() + self._encryptor.tag)
                self._ended = True
            have += len(pieces[-1])
        out = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        # Only the header or the tag can run past `size`: at most a few bytes are owed.
        self._owed = out[size:] if 0 <= size < len(out) else b""
        out = out[:size] if 0 <= size < len(out) else out
        self.digest.update(out)
        self.length += len(out)
        return out


class Opening:
    """A sealed object's bytes fed in as they arrive: the plaintext written out piece by piece
    (the last TAG bytes held back until the next piece shows they are not the tag), the tag
    checked by `close`. What it wrote is not to be trusted until `close` returns."""

    def __init__(self, key: bytes, object_key: str, write: Callable[[bytes], object]) -> None:
        self._key = key
        self._object_key = object_key
        self._write = write
        self._header = bytearray()
        self._held = b""  # the last bytes seen: the tag, if nothing follows
        self._decryptor: AEADDecryptionContext | None = None

    def feed(self, piece: memoryview | bytes) -> None:
        if len(self._header) < HEADER:
            wanted = HEADER - len(self._header)
            self._header += piece[:wanted]
            piece = piece[wanted:]
            if len(self._header) < HEADER:
                return
            if not self._header.startswith(MAGIC):
                raise IntegrityError(f"{self._object_key}: not an encrypted fleetline object")
        if not piece:
            return
        decryptor = self._started()
        if len(piece) >= TAG:
            # Enough arrived to show that what was held back is ciphertext.
            if self._held:
                self._write(decryptor.update(self._held))
            self._write(decryptor.update(piece[:-TAG]))
            self._held = bytes(piece[-TAG:])
        else:
            joined = self._held + bytes(piece)
            if len(joined) > TAG:
                self._write(decryptor.update(joined[:-TAG]))
            self._held = joined[-TAG:]

    def close(self) -> None:
        if len(self._header) < HEADER or len(self._held) < TAG:
            raise IntegrityError(f"{self._object_key}: not an encrypted fleetline object")
        try:
            self._write(self._started().finalize_with_tag(self._held))
        except InvalidTag:
            raise _altered(self._object_key) from None

    def _started(self) -> AEADDecryptionContext:
        if self._decryptor is None:
            nonce = bytes(self._header[len(MAGIC) : HEADER])
            decryptor = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).decryptor()
            decryptor.authenticate_additional_data(self._object_key.encode())
            self._decryptor = decryptor
        return self._decryptor


def cipher_for(key: bytes | None) -> ObjectCipher | None:
    """The cipher of a configured key (Settings.object_key()), None when sealing is off."""
    return ObjectCipher(key) if key else None


class SealedObjectStore:
    """An ObjectStore whose objects are encrypted on the way in and checked on the way out."""

    def __init__(self, store: ObjectStore, cipher: ObjectCipher | None) -> None:
        self.store = store
        self.cipher = cipher

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        if self.cipher is None:
            return self.store.put(key, data, content_type)
        return self.store.put(key, self.cipher.seal(key, data), "application/octet-stream")

    def get(self, key: str) -> bytes:
        blob = self.store.get(key)
        return blob if self.cipher is None else self.cipher.open(key, blob)

    def keys(self, prefix: str = "") -> list[str]:
        return self.store.keys(prefix)

    def delete(self, key: str) -> None:
        self.store.delete(key)
