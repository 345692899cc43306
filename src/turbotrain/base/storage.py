"""A remote store for a run's files (``run.remote``): a folder at a URI, through fsspec and its
back-ends. Credentials come from the back-end's usual places: nothing here reads or prints them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import uuid
from pathlib import Path
from typing import Any

from .errors import ConfigError

# the URI schemes a run may name, with the extra that brings their back-end (None: fsspec alone)
SCHEMES: dict[str, str | None] = {
    "s3": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "file": None,
}
_BACKENDS = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}
_CHATTY = ("aiobotocore", "botocore", "s3fs", "gcsfs", "adlfs", "azure")
# bounded retries and timeouts (not credentials): a store that is down costs seconds, not minutes
_OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}},
}


def why(exc: BaseException) -> str:
    """``exc`` in one line, short: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def check_uri(uri: str, setting: str = "run.remote") -> str:
    """``uri`` without a trailing slash, else one line naming ``setting`` (scheme, missing back-end)."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES or not rest.strip("/"):
        raise ConfigError(
            f"{setting}={uri!r} is not a store URI: give s3://BUCKET/PREFIX, gs://..., az://... or file:///PATH"
        )
    extra = SCHEMES[scheme]
    needed = ["fsspec"] + ([_BACKENDS[extra]] if extra else [])
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(
            f"{setting}={uri} needs {' and '.join(missing)}: pip install 'turbotrain[{extra or 'remote'}]'"
        )
    return uri.rstrip("/")


class Store:
    """The folder ``uri`` in a remote store; names are relative to it, with ``/`` separators."""

    def __init__(self, uri: str, setting: str = "run.remote") -> None:
        self.uri, self.setting = check_uri(uri, setting), setting
        import fsspec  # an optional extra: imported when a run names a store

        for name in _CHATTY:  # "Found credentials in environment variables" at INFO: not news
            logging.getLogger(name).setLevel(logging.WARNING)

        scheme = self.uri.partition("://")[0]
        self.fs, root = fsspec.core.url_to_fs(self.uri, **_OPTIONS.get(scheme, {}))
        self.root = root.rstrip("/")
        protocol = self.fs.protocol
        self._local = "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    def url(self, name: str = "") -> str:
        return f"{self.uri}/{name}" if name else self.uri

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def put(self, local: Path, name: str) -> None:
        """Upload file ``local`` as ``name`` (an object store makes it visible whole or not at all)."""
        if self._local:  # a folder holds the file; an object store has no folders
            self.fs.makedirs(self._path(name).rpartition("/")[0], exist_ok=True)
        self.fs.put_file(str(local), self._path(name))

    def put_bytes(self, name: str, data: bytes) -> None:
        if self._local:
            self.fs.makedirs(self._path(name).rpartition("/")[0], exist_ok=True)
        self.fs.pipe_file(self._path(name), data)

    def get(self, name: str, local: Path) -> None:
        """Download ``name`` into file ``local`` (its folder created)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(self._path(name), str(local))

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def files(self, under: str = "") -> dict[str, int]:
        """Every file under ``under`` as relative name -> size, read from the store now (no cache)."""
        self.fs.invalidate_cache()
        base = self._path(under)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        cut = len(self.root) + 1
        return {path[cut:]: int(info.get("size") or 0) for path, info in found.items()}

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def probe(self) -> None:
        """Write, read back and delete a small object, else a one-line ConfigError naming the setting."""
        name = f".turbotrain-probe-{uuid.uuid4().hex[:12]}"
        try:
            self.put_bytes(name, b"turbotrain\n")
            if self.read(name) != b"turbotrain\n":
                raise OSError("the object read back differs from the one written")
            self.remove(name)
        except Exception as exc:  # noqa: BLE001 - any refusal is the same mistake to fix: the store
            raise ConfigError(
                f"{self.setting}={self.uri}: the store cannot be written ({why(exc)}); check the bucket, "
                "the credentials (the back-end's environment or config files) and the endpoint"
            ) from None
