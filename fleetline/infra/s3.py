"""A real S3-protocol server on loopback: Versity's versitygw with its POSIX backend.

versitygw (Apache-2.0) is built from the Go module proxy with `go install` and cached under the
repository's ignored cache folder. Our code reaches it only through the `minio` client, so any
S3 store (MinIO, Ceph, AWS) can replace it by configuration alone.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from fleetline.errors import ServiceError
from fleetline.infra.process import ServiceProcess, run_checked

VERSITYGW_MODULE = "github.com/versity/versitygw/cmd/versitygw"
VERSITYGW_VERSION = "v1.8.0"


@dataclass(frozen=True)
class ObjectStoreServer:
    cache_dir: Path
    access_key: str
    secret_key: str
    port: int = 19000
    host: str = "127.0.0.1"
    region: str = "us-east-1"

    @property
    def binary(self) -> Path:
        return self.cache_dir / "bin" / f"versitygw-{VERSITYGW_VERSION}"

    @property
    def run_dir(self) -> Path:
        return self.cache_dir / "run" / f"s3-{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.run_dir / "data"

    @property
    def process(self) -> ServiceProcess:
        return ServiceProcess("versitygw", self.run_dir, self.host, self.port)

    def build(self) -> bool:
        """Build the server once; True if it had to be built now."""
        if self.binary.exists():
            return False
        if shutil.which("go") is None:
            raise ServiceError("go is not on PATH; it is needed once to build versitygw")
        gobin = self.cache_dir / "gobuild" / VERSITYGW_VERSION
        run_checked(
            ["go", "install", f"{VERSITYGW_MODULE}@{VERSITYGW_VERSION}"],
            what="building versitygw",
            # The module cache stays Go's own (shared by every checkout); only the binary is ours.
            env={"GOBIN": str(gobin), "GOFLAGS": "-modcacherw"},
            log=self.cache_dir / "logs" / "versitygw-build.log",
        )
        self.binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(gobin / "versitygw", self.binary)
        return True

    def start(self, timeout_s: float = 60.0) -> float:
        self.build()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return self.process.start(
            [
                str(self.binary),
                "--port",
                f"{self.host}:{self.port}",
                "--region",
                self.region,
                "--quiet",
                "posix",
                str(self.data_dir),
            ],
            # Credentials through the environment keep them out of `ps` output.
            env={"ROOT_ACCESS_KEY_ID": self.access_key, "ROOT_SECRET_ACCESS_KEY": self.secret_key},
            timeout_s=timeout_s,
        )

    def stop(self) -> bool:
        return self.process.stop(timeout_s=15.0)

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
