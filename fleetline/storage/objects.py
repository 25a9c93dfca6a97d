"""S3-compatible object storage through the `minio` client (versitygw here; MinIO, Ceph or AWS
in production, chosen by endpoint and credentials alone)."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol, cast
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.error import S3Error
from urllib3.connection import HTTPConnection
from urllib3.exceptions import HTTPError

from fleetline.config import S3Settings
from fleetline.errors import (
    ObjectMissing,
    ServiceUnavailable,
    StorageError,
    TransientStorageError,
)
from fleetline.probe import refusal

_MISSING = frozenset({"NoSuchKey", "NotFound", "NoSuchObject", "NoSuchBucket"})


def _translate(action: str, exc: Exception) -> StorageError:
    if isinstance(exc, S3Error):
        kind = ObjectMissing if exc.code in _MISSING else StorageError
        return kind(f"{action}: S3 {exc.code}: {exc.message}")
    return TransientStorageError(f"{action}: {type(exc).__name__}: {exc}")


class Readable(Protocol):
    """What a streamed upload reads from (a file, a buffer, a reader that seals or hashes)."""

    def read(self, size: int = -1, /) -> bytes: ...


class Objects(Protocol):
    """What a reader or writer of objects needs: `ObjectStore`, or `SealedObjectStore` over it
    (storage/crypto.py), which seals what it writes when a key is configured."""

    def put(self, key: str, data: bytes, content_type: str = ...) -> str: ...

    def get(self, key: str) -> bytes: ...

    def keys(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...


def probe(s3: S3Settings, timeout_s: float = 5.0) -> None:
    """Raise ServiceUnavailable unless the S3 server accepts a connection within `timeout_s`
    (the client's own retries would take minutes against a silent host)."""
    endpoint = urlsplit(f"//{s3.endpoint}")
    port = endpoint.port or (443 if s3.secure else 80)
    why = refusal(endpoint.hostname or "", port, timeout_s)
    if why is not None:
        raise ServiceUnavailable(
            f"the S3 server is not answering at {s3.endpoint} ({why}); start the local one with "
            "`fleetline infra start`, or point FLEETLINE_S3_ENDPOINT at a running one"
        )


# minio's own pool waits 5 minutes to connect and 5 minutes for each read, per try: across a
# cut link a call hung for most of an hour. These give up on a silent server in seconds (a
# read waits longer: a large part may take a while to be acknowledged), and keepalive probes
# find a connection that died under a cut instead of waiting on it.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0
# A streamed read's piece (small enough to stay in the cache while it is hashed or decrypted),
# and S3's smallest and largest multipart pieces.
CHUNK = 1 << 20
MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30
_KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3),
]


def _http_pool(s3: S3Settings) -> urllib3.PoolManager:
    """minio's connection pool with our timeouts; its retries and certificate checks as they
    are (a retry of an idempotent S3 call on 500, 502, 503, 504, five times)."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S),
        maxsize=10,
        cert_reqs="CERT_REQUIRED" if s3.secure else "CERT_NONE",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]),
        socket_options=[*HTTPConnection.default_socket_options, *_KEEPALIVE],
    )


@dataclass
class ObjectStore:
    client: Minio
    bucket: str

    @classmethod
    def from_settings(cls, s3: S3Settings, bucket: str | None = None) -> ObjectStore:
        client = Minio(
            s3.endpoint,
            access_key=s3.access_key,
            secret_key=s3.secret_key,
            secure=s3.secure,
            region=s3.region,
            http_client=_http_pool(s3),
        )
        return cls(client, bucket or s3.bucket)

    def ensure_bucket(self) -> None:
        try:
            if not self.client.bucket_exists(self.bucket):
                self.client.make_bucket(self.bucket)
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"creating bucket {self.bucket}", exc) from None

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """Store `data` under `key`; return the object's ETag."""
        try:
            result = self.client.put_object(
                self.bucket, key, io.BytesIO(data), len(data), content_type=content_type
            )
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"writing s3://{self.bucket}/{key}", exc) from None
        return result.etag or ""

    def put_file(self, key: str, path: str) -> str:
        """Store the file at `path` under `key` (streamed, in parts when large)."""
        try:
            result = self.client.fput_object(self.bucket, key, path)
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"writing s3://{self.bucket}/{key}", exc) from None
        return result.etag or ""

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(self.bucket, key)
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"reading s3://{self.bucket}/{key}", exc) from None
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def put_stream(self, key: str, reader: Readable, length: int, part_size: int) -> str:
        """Store the `length` bytes `reader` gives: in one PUT when they fit in `part_size`,
        else a multipart upload of `part_size` pieces, one after another (minio's parallel
        uploads queue every piece read ahead: a large object would be held whole)."""
        try:
            result = self.client.put_object(
                self.bucket,
                key,
                cast(BinaryIO, reader),  # minio only calls read()
                length,
                part_size=min(max(part_size, MIN_PART_SIZE), MAX_PART_SIZE),
                num_parallel_uploads=1,
            )
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"writing s3://{self.bucket}/{key}", exc) from None
        return result.etag or ""

    def stream(self, key: str, into: Callable[[bytes], object], chunk: int = CHUNK) -> int:
        """Hand the object's bytes to `into` `chunk` at a time as they arrive (`chunks`); the
        bytes read. The object is never held whole, and each piece is worked on while it is
        still in the cache."""
        total = 0
        for piece in self.chunks(key, chunk):
            into(piece)
            total += len(piece)
        return total

    def chunks(self, key: str, size: int = 1 << 18) -> Iterator[bytes]:
        """The object's bytes, `size` at a time, as they arrive (a reader may pace itself)."""
        try:
            response = self.client.get_object(self.bucket, key)
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"reading s3://{self.bucket}/{key}", exc) from None
        try:
            yield from response.stream(size)
        except (HTTPError, OSError) as exc:
            raise _translate(f"reading s3://{self.bucket}/{key}", exc) from None
        finally:
            response.close()
            response.release_conn()

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(self.etags(prefix))

    def etags(self, prefix: str = "") -> dict[str, str]:
        """Each object under `prefix` and its ETag (what changes when it is written again), in
        one listing."""
        try:
            return {
                obj.object_name: (obj.etag or "").strip('"')
                for obj in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)
                if obj.object_name is not None
            }
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"listing s3://{self.bucket}/{prefix}", exc) from None

    def size(self, key: str) -> int:
        """The object's size in bytes."""
        try:
            return self.client.stat_object(self.bucket, key).size or 0
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"stat s3://{self.bucket}/{key}", exc) from None

    def delete(self, key: str) -> None:
        try:
            self.client.remove_object(self.bucket, key)
        except (S3Error, HTTPError, OSError) as exc:
            raise _translate(f"deleting s3://{self.bucket}/{key}", exc) from None
