"""`lakecache://bucket/key` as an fsspec filesystem.

Paths are `bucket/key` (fsspec strips the protocol). A file opened for
reading is pinned to the ETag it had when opened: if the object changes
while it is open, reads fail with ObjectChangedError rather than mixing
versions. Read-only: writes go through the mount or S3.
"""

from __future__ import annotations

import os
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ._native import Client


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def connect(
    registry: str | None = None,
    worker: str | None = None,
    token_file: str | None = None,
    tls_ca: str | None = None,
    snapshot: str | None = None,
    s3_fallback: bool | None = None,
    s3_endpoint: str | None = None,
    s3_region: str | None = None,
    s3_path_style: bool | None = None,
    local_cache: str | None = None,
) -> Client:
    """A Client with the CLI's defaults and environment variables. As for
    the mount, a read no worker can answer goes straight to S3 unless
    `s3_fallback=False` (or $LAKECACHE_NO_S3_FALLBACK=1). `local_cache`
    (or $LAKECACHE_LOCAL_CACHE): a running mount's `--local-cache`
    directory, whose node-local tier reads then share."""
    if s3_fallback is None:
        s3_fallback = not _env_flag("LAKECACHE_NO_S3_FALLBACK")
    if s3_path_style is None:
        s3_path_style = bool(_env_flag("LAKECACHE_S3_PATH_STYLE"))
    return Client(
        registry=registry or os.environ.get("LAKECACHE_REGISTRY"),
        worker=worker or os.environ.get("LAKECACHE_WORKER"),
        token_file=token_file or os.environ.get("LAKECACHE_TOKEN_FILE"),
        tls_ca=tls_ca or os.environ.get("LAKECACHE_TLS_CA"),
        snapshot=snapshot,
        s3_fallback=s3_fallback,
        s3_endpoint=s3_endpoint or os.environ.get("LAKECACHE_S3_ENDPOINT"),
        s3_region=s3_region or os.environ.get("LAKECACHE_S3_REGION"),
        s3_path_style=s3_path_style,
        local_cache=local_cache or os.environ.get("LAKECACHE_LOCAL_CACHE") or None,
    )


class LakecacheFileSystem(AbstractFileSystem):
    protocol = ("lakecache",)
    root_marker = ""

    def __init__(
        self,
        registry: str | None = None,
        worker: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        snapshot: str | None = None,
        client: Client | None = None,
        s3_fallback: bool | None = None,
        s3_endpoint: str | None = None,
        s3_region: str | None = None,
        s3_path_style: bool | None = None,
        local_cache: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.client = client or connect(
            registry=registry,
            worker=worker,
            token_file=token_file,
            tls_ca=tls_ca,
            snapshot=snapshot,
            s3_fallback=s3_fallback,
            s3_endpoint=s3_endpoint,
            s3_region=s3_region,
            s3_path_style=s3_path_style,
            local_cache=local_cache,
        )

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        for p in ("lakecache://", "s3://"):
            if path.startswith(p):
                path = path[len(p) :]
        return path.rstrip("/")

    @staticmethod
    def _uri(path: str) -> str:
        return "s3://" + path

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        path = self._strip_protocol(path)
        bucket, _, key = path.partition("/")
        prefix = f"{key}/" if key else ""
        objects, prefixes = self.client.list(f"s3://{bucket}/{prefix}", "/")
        entries = [
            {"name": f"{bucket}/{k}", "size": size, "type": "file", "ETag": etag}
            for k, size, etag in objects
            if k != prefix
        ]
        entries += [
            {"name": f"{bucket}/{p.rstrip('/')}", "size": 0, "type": "directory"} for p in prefixes
        ]
        if not entries:
            if key and self._object_info(path) is not None:
                return [self.info(path)] if detail else [path]
            if key:
                raise FileNotFoundError(path)
        entries.sort(key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    def _object_info(self, path: str) -> dict | None:
        try:
            size, etag, mtime_ms = self.client.stat(self._uri(path))
        except FileNotFoundError:
            return None
        return {"name": path, "size": size, "type": "file", "ETag": etag, "mtime": mtime_ms / 1e3}

    def info(self, path: str, **kwargs: Any) -> dict:
        path = self._strip_protocol(path)
        bucket, _, key = path.partition("/")
        if not key:
            return {"name": bucket, "size": 0, "type": "directory"}
        found = self._object_info(path)
        if found is not None:
            return found
        objects, prefixes = self.client.list(f"s3://{bucket}/{key}/", "/")
        if objects or prefixes:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict | None = None,
        **kwargs: Any,
    ) -> LakecacheFile:
        if mode != "rb":
            raise PermissionError(f"{path}: the lakecache fsspec filesystem is read-only")
        return LakecacheFile(self, path, mode, block_size or 8 << 20, cache_options=cache_options)


class LakecacheFile(AbstractBufferedFile):
    def __init__(self, fs: LakecacheFileSystem, path: str, mode: str, block_size: int, **kw: Any):
        path = fs._strip_protocol(path)
        info = fs.info(path)
        if info["type"] != "file":
            raise IsADirectoryError(path)
        self.etag = info["ETag"]
        super().__init__(fs, path, mode, block_size, size=info["size"], **kw)

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if start >= end:
            return b""
        # The client splits large ranges into pieces fetched concurrently.
        return self.fs.client.read(self.fs._uri(self.path), start, end, self.etag)
