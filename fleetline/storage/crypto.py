"""Client-side encryption for objects: AES-256-GCM, bound to the object's key.

Used where the S3 server offers no server-side encryption (versitygw's POSIX backend does not):
a blob is `FLC1 || nonce(12) || ciphertext+tag`, with the object key as associated data, so a
ciphertext moved to another key, truncated or altered fails to decrypt.
"""

from __future__ import annotations

import base64
import binascii
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fleetline.errors import ConfigError, IntegrityError
from fleetline.storage.objects import ObjectStore

MAGIC = b"FLC1"


class ObjectCipher:
    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ConfigError("the object encryption key must be 32 bytes (AES-256)")
        self._aead = AESGCM(key)

    @classmethod
    def from_base64(cls, text: str) -> ObjectCipher:
        try:
            return cls(base64.b64decode(text, validate=True))
        except binascii.Error:
            raise ConfigError("FLEETLINE_OBJECT_ENCRYPTION_KEY is not base64") from None

    def seal(self, object_key: str, data: bytes) -> bytes:
        nonce = os.urandom(12)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, object_key.encode())

    def open(self, object_key: str, blob: bytes) -> bytes:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 12 + 16:
            raise IntegrityError(f"{object_key}: not an encrypted fleetline object")
        # Views, not slices: a slice of a large blob is a copy, and on these machines copying
        # into fresh memory cost three times the decryption itself.
        view = memoryview(blob)
        nonce = view[len(MAGIC) : len(MAGIC) + 12]
        try:
            return self._aead.decrypt(nonce, view[len(MAGIC) + 12 :], object_key.encode())
        except InvalidTag:
            raise IntegrityError(
                f"{object_key}: decryption failed (wrong key or altered object)"
            ) from None


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
