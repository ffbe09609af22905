"""Where files' bytes live, behind one small interface.

    writer = store.create(file_id)      # write(chunk) ... commit() -> bytes, or abort()
    with store.open(file_id) as f: ...  # a readable binary file (iterate its lines)
    store.delete(file_id)

Files are written once and never changed: a writer's bytes become visible all at once
on `commit()` (or never), so a reader never sees half a file and a driver that
regenerates an output file after a crash replaces it whole.

`DirectoryStore` keeps each file as `<root>/<file_id>`; every API replica must see the
same directory (a shared volume), since any replica may drive any batch.

An S3-compatible store plugs in here: `create` starts a multipart upload (`write`
buffers to a part size and uploads parts, `commit` completes it, `abort` aborts it),
`open` returns the object's streaming body, `delete` deletes the object. Build it in
`open_store` from a setting (e.g. a `s3://bucket/prefix` files_dir).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Iterable, Protocol

from kvfleet.settings import Settings


class FileMissing(Exception):
    """The store holds no bytes for this id (deleted, or never committed)."""


class Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    def commit(self) -> int:
        """Make the file visible under its id; its size in bytes."""

    def abort(self) -> None:
        """Throw away what was written."""


class FileStore(Protocol):
    def create(self, file_id: str) -> Writer: ...

    def open(self, file_id: str) -> BinaryIO:
        """Raises FileMissing."""

    def delete(self, file_id: str) -> None:
        """No error when it is already gone."""


def put(store: FileStore, file_id: str, chunks: Iterable[bytes]) -> int:
    """Write a whole file from `chunks`; its size."""
    writer = store.create(file_id)
    try:
        for chunk in chunks:
            writer.write(chunk)
    except BaseException:
        writer.abort()
        raise
    return writer.commit()


class _DirectoryWriter:
    def __init__(self, partial: Path, final: Path) -> None:
        self._partial, self._final = partial, final
        self._file = open(partial, "wb")
        self._bytes = 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._bytes += len(data)

    def commit(self) -> int:
        self._file.flush()
        os.fsync(self._file.fileno())  # the record that names this file is written next
        self._file.close()
        os.replace(self._partial, self._final)  # atomic: readers see all of it or nothing
        return self._bytes

    def abort(self) -> None:
        self._file.close()
        self._partial.unlink(missing_ok=True)


class DirectoryStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._partial = self.root / ".partial"
        self._partial.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise FileMissing(file_id)  # ids are ours, but never let one name a path elsewhere
        return self.root / file_id

    def create(self, file_id: str) -> _DirectoryWriter:
        # A unique partial name: two writers of one id (a driver taken over mid-write)
        # never write into each other's file; the last commit wins, whole.
        partial = self._partial / f"{file_id}.{secrets.token_hex(4)}"
        return _DirectoryWriter(partial, self._path(file_id))

    def open(self, file_id: str) -> BinaryIO:
        try:
            return open(self._path(file_id), "rb")
        except FileNotFoundError:
            raise FileMissing(file_id) from None

    def delete(self, file_id: str) -> None:
        try:
            self._path(file_id).unlink(missing_ok=True)
        except FileMissing:
            pass


def open_store(settings: Settings) -> FileStore:
    """The store the settings name: `files_dir`, or `<home>/files`."""
    return DirectoryStore(Path(settings.batch.files_dir or Path(settings.home) / "files"))
