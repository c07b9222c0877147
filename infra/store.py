"""The artifact store: durable, checksummed stage outputs in a local folder or any fsspec URL.

Layout under the root::

    <root>/<run>/run.json                                   run-level JSON documents (put_json)
    <root>/<run>/data/<stage>/                              run-level artifacts (iteration=None)
    <root>/<run>/iter-000012/<stage>/                       an iteration's artifact
    <root>/<run>/iter-000012/<stage>@<version>/             a sibling version (e.g. a replay)

Each artifact folder holds its data files and ``_manifest.json``. The manifest is written last,
with a conditional create, so an artifact is visible exactly when it is completely written and a
commit happens at most once; files without a manifest are garbage of an interrupted attempt.
Every read checks sha256, byte size and (for Parquet) row count against the manifest.

Checksums catch corruption, not a writer: with a key in ``RLSTAGE_STORE_HMAC_KEY`` every manifest
and run document is signed (HMAC-SHA256 over its content) and readers refuse unsigned or
mis-signed ones, so only holders of the key can make the store say anything.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import json
import logging
import os
import posixpath
import re
import shutil
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from pydantic import ValidationError

from rlstage.schemas.artifacts import SCHEMA_VERSION
from rlstage.schemas.manifest import FileEntry, Manifest

log = logging.getLogger(__name__)

T = TypeVar("T")

MANIFEST = "_manifest.json"
MAIN = "main"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_ITER = re.compile(r"^iter-(\d+)$")
_CHUNK = 8 << 20  # streaming block for hashing and copying large files
# Parquet writer settings are pinned so the same table always gives the same bytes.
_PARQUET = dict(
    compression="zstd",
    compression_level=3,
    use_dictionary=True,
    write_statistics=True,
    version="2.6",
    data_page_version="1.0",
    row_group_size=128 * 1024,
    data_page_size=1 << 20,
    store_schema=True,
    write_page_index=False,
)
# Backends whose conditional create is a real server-side/kernel check, not check-then-write.
_ATOMIC_CREATE = {"s3", "s3a"}
# Errors that retrying cannot fix: callers interpret or report them at once.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError)
_PERMANENT_ERRNO = {
    errno.EINVAL,
    errno.ENOSPC,
    errno.EROFS,
    errno.EACCES,
    errno.ENAMETOOLONG,
    errno.ENOTEMPTY,
}


def _transient_types() -> tuple[type[BaseException], ...]:
    # botocore's connection errors are not OSErrors; include them when botocore is installed.
    types: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    try:
        from botocore import exceptions as bx

        types += [bx.ConnectionError, bx.HTTPClientError, bx.ReadTimeoutError]
    except ImportError:
        pass
    return tuple(types)


_TRANSIENT = _transient_types()


def store_identity(root: str) -> str:
    """The store a run lives in, as one string: a local folder's absolute path, else the URL."""
    if "://" in root and not root.startswith("file://"):
        return root.rstrip("/")
    return str(Path(root.removeprefix("file://")).expanduser().resolve())


class StoreError(RuntimeError):
    """A store operation failed; the message is one line naming the URI."""


class ArtifactCorrupt(StoreError):
    """A committed artifact does not match its manifest (checksum, size, rows, missing file)."""


HMAC_KEY_ENV = "RLSTAGE_STORE_HMAC_KEY"
_SIGNATURE = "signature"  # the manifest field (and, prefixed "_", the run documents' key) holding it


def _hmac_key() -> bytes | None:
    key = os.environ.get(HMAC_KEY_ENV)
    if key is None:
        return None
    if not key:  # an unset shell variable expanded to "" must not silently turn signing off
        raise StoreError(f"{HMAC_KEY_ENV} is set but empty")
    return key.encode()


def _sign(key: bytes, content: dict) -> str:
    """HMAC-SHA256 of ``content`` (a parsed JSON document without its signature) in canonical form."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def _check_signature(key: bytes, uri: str, content: dict, signature: Any) -> None:
    if not isinstance(signature, str):
        raise ArtifactCorrupt(f"{uri} is unsigned, but {HMAC_KEY_ENV} is set (only signed documents are read)")
    if not hmac.compare_digest(signature, _sign(key, content)):
        raise ArtifactCorrupt(f"{uri}: signature does not match ({HMAC_KEY_ENV}): edited, or signed with another key")


class CommitConflict(StoreError):
    """Another writer committed the same manifest (or JSON document) first."""


def _check_name(kind: str, value: Any) -> str:
    # Defence in depth against path traversal: the config validates these names too.
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise StoreError(f"invalid {kind} {value!r}: must match {_NAME.pattern} and contain no '..'")
    return value


def _check_relpath(kind: str, value: Any) -> str:
    # File names inside an artifact may have folders ("model/config.json") but never escape it.
    if not isinstance(value, str) or not value or value.startswith("/") or "\\" in value:
        raise StoreError(f"invalid {kind} {value!r}: must be a relative posix path")
    parts = value.split("/")
    if any(p in ("", ".", "..") for p in parts) or value == MANIFEST:
        raise StoreError(f"invalid {kind} {value!r}: empty, '.', '..' parts or the manifest name")
    return value


def _precondition_failed(exc: BaseException) -> bool:
    # Walk the cause chain for a botocore error response with code PreconditionFailed (HTTP 412).
    seen: BaseException | None = exc
    while seen is not None:
        err = (getattr(seen, "response", None) or {}).get("Error", {})
        if err.get("Code") in ("PreconditionFailed", "412"):
            return True
        seen = seen.__cause__
    return False


def _sha256_file(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def parquet_bytes(table: pa.Table) -> bytes:
    """Serialize ``table`` to Parquet deterministically (same table -> same bytes)."""
    buf = io.BytesIO()
    # combine_chunks: page boundaries must not depend on how the table happened to be chunked.
    pq.write_table(table.combine_chunks(), buf, **_PARQUET)
    return buf.getvalue()


class ArtifactStore:
    """Committed, checksummed artifacts under ``root`` (a local folder or an fsspec URL)."""

    backoff_base: float = 0.2  # seconds; doubled at each retry of a transient error

    def __init__(self, root: str, storage_options: dict | None = None, retries: int = 3) -> None:
        if not isinstance(root, str) or not root:
            raise StoreError(f"store root must be a non-empty string, got {root!r}")
        self.retries = max(0, int(retries))
        self.storage_options = dict(storage_options or {})
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(root), **self.storage_options)
        self.fs: fsspec.AbstractFileSystem = fs
        self._local = isinstance(fs, LocalFileSystem)
        if self._local:
            path = os.path.abspath(path)
            self.root: str = path
        else:
            self.root = root.rstrip("/")
        self._base = path.rstrip("/") or "/"
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self._atomic_create = self._local or bool(set(protocols) & _ATOMIC_CREATE)
        if not self._atomic_create:
            log.warning(
                "store %s: %s has no atomic create; commits are not exactly-once", self.root, protocols[0]
            )

    # ------------------------------------------------------------------ paths
    def _join(self, path: str, *parts: str) -> str:
        return os.path.join(path, *parts) if self._local else posixpath.join(path, *parts)

    def _uri(self, path: str) -> str:
        # Users see URIs in the root's own spelling (plain path locally, s3://... remotely).
        if self._local:
            return path
        rel = path[len(self._base) :].lstrip("/")
        return f"{self.root}/{rel}" if rel else self.root

    def _rel_dir(self, run: str, iteration: int | None, stage: str, version: str) -> list[str]:
        _check_name("run name", run)
        _check_name("stage", stage)
        _check_name("version", version)
        folder = stage if version == MAIN else f"{stage}@{version}"
        if iteration is None:
            return [run, "data", folder]
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise StoreError(f"invalid iteration {iteration!r}: must be a non-negative int or None")
        return [run, f"iter-{iteration:06d}", folder]

    def _dir(self, run: str, iteration: int | None, stage: str, version: str = MAIN) -> str:
        return self._join(self._base, *self._rel_dir(run, iteration, stage, version))

    def artifact_dir(self, run: str, iteration: int | None, stage: str, version: str = MAIN) -> str:
        """URI of the folder holding one artifact (whether or not it is committed)."""
        return self._uri(self._dir(run, iteration, stage, version))

    def _mdir(self, m: Manifest) -> str:
        return self._dir(m.run, m.iteration, m.stage, m.version)

    def uri(self, manifest: Manifest, name: str) -> str:
        """URI of one file of a committed artifact (``name`` as in ``read_table``/``read_bytes``)."""
        rel = self._resolve(manifest, name)
        return self._uri(self._join(self._mdir(manifest), *rel.split("/")))

    def _resolve(self, manifest: Manifest, name: str) -> str:
        for cand in (name, f"{name}.parquet"):
            if cand in manifest.files:
                _check_relpath("file name in manifest", cand)
                return cand
        if any(k.startswith(name.rstrip("/") + "/") for k in manifest.files):
            return name.rstrip("/")
        raise StoreError(
            f"artifact {self._uri(self._mdir(manifest))} has no file {name!r} (holds {sorted(manifest.files)})"
        )

    # ------------------------------------------------------------------ retried I/O
    def _io(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn`` retrying transient errors with exponential backoff; permanent ones surface.

        FileNotFoundError and FileExistsError pass through unchanged (callers give them meaning);
        any other failure becomes a StoreError naming ``what`` (a URI).
        """
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, FileExistsError, StoreError):
                raise
            except Exception as e:
                transient = isinstance(e, _TRANSIENT) and not (
                    isinstance(e, _PERMANENT) or getattr(e, "errno", None) in _PERMANENT_ERRNO
                )
                if not transient or attempt >= self.retries:
                    tries = f" (after {attempt + 1} attempts)" if transient else ""
                    raise StoreError(f"{what}: {type(e).__name__}: {e}{tries}") from e
                delay = self.backoff_base * (2**attempt)
                log.warning(
                    "transient store error on %s (%s: %s), retry in %.2fs", what, type(e).__name__, e, delay
                )
                time.sleep(delay)
                attempt += 1

    def _cat(self, path: str) -> bytes:
        self._refuse_links(path)
        return self._io(self._uri(path), self.fs.cat_file, path)

    def _refuse_links(self, path: str) -> None:
        """Refuse a symbolic link anywhere below the root on the way to ``path``: a store's bytes are its own files,
        never what a link planted in it points at (the root itself may be reached through links). Object stores have
        no links."""
        if not self._local:
            return
        rel = os.path.relpath(path, self._base)
        if rel.startswith(".."):
            return
        here = self._base
        for part in rel.split(os.sep):
            here = os.path.join(here, part)
            if os.path.islink(here):
                raise ArtifactCorrupt(f"{here}: a symbolic link inside the store (to {os.readlink(here)}); it is not followed")

    def _write(self, path: str, data: bytes) -> None:
        # Plain (overwriting) write; locally fsynced so a later manifest never outlives its data.
        if self._local:
            self._io(self._uri(path), self._local_write, path, data)
        else:
            self._io(self._uri(path), self.fs.pipe_file, path, data)

    @staticmethod
    def _local_write(path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def _rm(self, path: str, recursive: bool = False) -> None:
        try:
            if recursive:
                self._io(self._uri(path), self.fs.rm, path, recursive=True)
            else:
                self._io(self._uri(path), self.fs.rm_file, path)
        except FileNotFoundError:
            pass  # already gone is what we wanted
        self.fs.invalidate_cache(path)

    def _find(self, path: str) -> list[str]:
        # Listings are cached by some backends (s3fs); a commit must see the current state.
        self.fs.invalidate_cache(path)
        try:
            return self._io(self._uri(path), self.fs.find, path)
        except FileNotFoundError:
            return []

    def _glob(self, pattern: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            return self._io(self._uri(pattern), self.fs.glob, pattern)
        except FileNotFoundError:
            return []

    def _create_exclusive(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` only if it does not exist: raise FileExistsError otherwise."""
        if self._local:
            self._io(self._uri(path), self._local_create, path, data)
        else:
            # s3fs maps mode="create" to PutObject(IfNoneMatch="*"); a 412 becomes FileExistsError.
            try:
                self._io(self._uri(path), self.fs.pipe_file, path, data, mode="create")
            except StoreError as e:
                # s3fs only says FileExistsError when the 412 names its condition; some servers don't.
                if _precondition_failed(e):
                    raise FileExistsError(path) from e
                raise

    @staticmethod
    def _local_create(path: str, data: bytes) -> None:
        # Write a private temp file then hard-link it: link(2) fails if the name exists, and
        # readers never see a partially written manifest.
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # make the new directory entry durable
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ root
    def check_writable(self) -> None:
        """Write and delete a probe file under the root, or raise StoreError saying why not."""
        probe = self._join(self._base, f".rlstage-probe-{uuid.uuid4().hex}")
        try:
            self._write(probe, b"probe")
            self._rm(probe)
        except StoreError as e:
            cause = e.__cause__ or e
            raise StoreError(
                f"store root {self.root} cannot be written: {type(cause).__name__}: {cause}"
            ) from e
        except OSError as e:  # FileNotFoundError/FileExistsError pass through _io unchanged
            raise StoreError(f"store root {self.root} cannot be written: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ manifests
    def manifest(self, run: str, iteration: int | None, stage: str, version: str = MAIN) -> Manifest | None:
        """The committed manifest, or None when the artifact is not committed."""
        path = self._join(self._dir(run, iteration, stage, version), MANIFEST)
        try:
            raw = self._cat(path)
        except FileNotFoundError:
            return None
        try:
            m = Manifest.model_validate_json(raw)
        except ValidationError as e:
            first = e.errors()[0]
            raise ArtifactCorrupt(
                f"manifest {self._uri(path)} is unreadable: {first['loc']}: {first['msg']}"
            ) from e
        key = _hmac_key()
        if key is not None:
            content = json.loads(raw)
            _check_signature(key, self._uri(path), content, content.pop(_SIGNATURE, None))
        for rel in m.files:  # an entry that would escape the artifact's folder: the whole manifest is refused
            try:
                _check_relpath("file name", rel)
            except StoreError as e:
                raise ArtifactCorrupt(f"manifest {self._uri(path)} lists {e}") from None
        where = (m.run, m.iteration, m.stage, m.version)
        if where != (run, iteration, stage, version):
            # A manifest copied or moved by hand would point reads at the wrong folder.
            raise ArtifactCorrupt(f"manifest {self._uri(path)} describes {where}, not its own location")
        return m

    def committed(
        self, run: str, iteration: int | None, stage: str, key: str, version: str = MAIN
    ) -> Manifest | None:
        """The manifest if committed with this cache key (and the current schema), else None."""
        m = self.manifest(run, iteration, stage, version)
        if m is None or m.key != key or m.schema_version != SCHEMA_VERSION:
            return None
        return m

    # ------------------------------------------------------------------ commit
    def commit(
        self,
        run: str,
        iteration: int | None,
        stage: str,
        *,
        key: str,
        config_hash: str,
        code_version: str,
        inputs: dict[str, str],
        tables: dict[str, pa.Table] | None = None,
        blobs: dict[str, bytes] | None = None,
        dirs: dict[str, str] | None = None,
        written: dict[str, FileEntry] | None = None,
        meta: dict | None = None,
        version: str = MAIN,
        artifact_id: str | None = None,
        before_manifest: Callable[[], None] | None = None,
    ) -> Manifest:
        """Write an artifact's files, then its manifest with a conditional create (exactly once).

        ``written``: files other writers already put into this artifact (``put_files``), listed as they wrote
        them; each must be there at its size. ``before_manifest`` runs between the files and the manifest
        (the failure drill's kill point inside a commit). Raises CommitConflict when another writer's
        manifest appears before ours.
        """
        folder = self._dir(run, iteration, stage, version)
        plan = self._plan(folder, tables or {}, blobs or {}, dirs or {}, written or {})
        # Built (and serialized once) before any write: bad meta must fail before files land.
        m = Manifest(
            schema_version=SCHEMA_VERSION,
            artifact_id=artifact_id or uuid.uuid4().hex,
            run=run,
            iteration=iteration,
            stage=stage,
            version=version,
            key=key,
            config_hash=config_hash,
            code_version=code_version,
            created_at=datetime.now(UTC).isoformat(),
            inputs=dict(inputs),
            meta=dict(meta or {}),
        )
        try:
            m.model_dump_json()
        except ValueError as e:
            raise StoreError(f"artifact {self._uri(folder)}: meta is not JSON-serializable: {e}") from e
        manifest_path = self._join(folder, MANIFEST)
        # 1. A stale output becomes invisible before anything of it is replaced.
        self._rm(manifest_path)
        # Leftovers of an old version or a failed attempt that the new files will not overwrite.
        planned = {self._join(folder, *rel.split("/")) for rel in plan}
        for p in self._find(folder):
            # Manifest temp files may be a concurrent writer's create in flight: never swept.
            if self._norm(p) not in planned and not posixpath.basename(p).startswith(MANIFEST):
                self._rm(p)
        # 2. Data files, hashed as written.
        files = {rel: writer() for rel, writer in sorted(plan.items())}
        if before_manifest is not None:
            before_manifest()
        # 3. The manifest, last and exclusively.
        m = m.model_copy(update={"files": files})
        key = _hmac_key()
        if key is not None:  # signed as readers will parse it (JSON floats, nulls), not as held in memory
            m = m.model_copy(update={_SIGNATURE: _sign(key, json.loads(m.model_dump_json(exclude={_SIGNATURE})))})
        data = m.model_dump_json(indent=2).encode()
        try:
            self._create_exclusive(manifest_path, data)
        except FileExistsError as e:
            # A retried create whose first try did land (reply lost) reads back byte-identical.
            try:
                if self._cat(manifest_path) == data:
                    return m
            except (FileNotFoundError, StoreError):
                pass
            raise CommitConflict(
                f"manifest {self._uri(manifest_path)} was committed by another writer"
            ) from e
        return m

    def _norm(self, path: str) -> str:
        # fs.find returns protocol-less paths; local ones may differ in separators.
        return os.path.normpath(path) if self._local else self.fs._strip_protocol(path)

    def put_files(
        self, run: str, iteration: int | None, stage: str, name: str, local_dir: str, version: str = MAIN
    ) -> dict[str, FileEntry]:
        """Write ``local_dir``'s files under ``<name>/`` of an artifact that another writer commits (a trainer
        rank's optimizer partition, which rank 0 lists with ``commit(written=...)``). Nothing is visible until
        that commit: a stale manifest of the artifact is removed first."""
        folder = self._dir(run, iteration, stage, version)
        self._rm(self._join(folder, MANIFEST))
        plan = self._plan(folder, {}, {}, {name: local_dir}, {})
        return {rel: writer() for rel, writer in sorted(plan.items())}

    def _check_written(self, folder: str, rel: str, entry: FileEntry) -> FileEntry:
        path = self._join(folder, *rel.split("/"))
        self.fs.invalidate_cache(path)
        try:
            size = self._io(self._uri(path), self.fs.size, path)
        except FileNotFoundError:
            size = None
        if size != entry.bytes:
            raise StoreError(f"{self._uri(path)}: written by another writer as {entry.bytes} bytes, found {size}")
        return entry

    def _plan(
        self,
        folder: str,
        tables: dict[str, pa.Table],
        blobs: dict[str, bytes],
        dirs: dict[str, str],
        written: dict[str, FileEntry],
    ) -> dict[str, Callable[[], FileEntry]]:
        """Map each relpath to a writer returning its FileEntry; validates names and collisions."""
        plan: dict[str, Callable[[], FileEntry]] = {}

        def add(rel: str, writer: Callable[[], FileEntry]) -> None:
            _check_relpath("artifact file name", rel)
            if rel in plan:
                raise StoreError(f"artifact {self._uri(folder)}: file {rel!r} given twice")
            plan[rel] = writer

        for name, table in tables.items():
            if not isinstance(table, pa.Table):
                raise StoreError(f"artifact {self._uri(folder)}: table {name!r} is a {type(table).__name__}")
            rel = name if name.endswith(".parquet") else f"{name}.parquet"
            add(
                rel,
                lambda rel=rel, table=table: self._put_bytes(
                    folder, rel, parquet_bytes(table), table.num_rows
                ),
            )
        for name, blob in blobs.items():
            add(name, lambda name=name, blob=blob: self._put_bytes(folder, name, bytes(blob), None))
        for name, local in dirs.items():
            _check_relpath("dir name", name)
            if not os.path.isdir(local):
                raise StoreError(
                    f"artifact {self._uri(folder)}: dir {name!r} source {local} is not a directory"
                )
            for dirpath, dirnames, filenames in os.walk(local):
                dirnames.sort()
                for fn in sorted(filenames):
                    src = os.path.join(dirpath, fn)
                    rel = f"{name}/{os.path.relpath(src, local).replace(os.sep, '/')}"
                    add(rel, lambda rel=rel, src=src: self._put_file(folder, rel, src))
        for rel, entry in written.items():
            add(rel, lambda rel=rel, entry=entry: self._check_written(folder, rel, entry))
        for rel in plan:
            # A file and a folder of the same name cannot coexist in a filesystem.
            if any(other.startswith(rel + "/") for other in plan):
                raise StoreError(f"artifact {self._uri(folder)}: {rel!r} is both a file and a folder")
        return plan

    def _put_bytes(self, folder: str, rel: str, data: bytes, rows: int | None) -> FileEntry:
        self._write(self._join(folder, *rel.split("/")), data)
        return FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), rows=rows)

    def _put_file(self, folder: str, rel: str, src: str) -> FileEntry:
        dst = self._join(folder, *rel.split("/"))
        if self._local:
            digest, size = self._io(self._uri(dst), self._local_copy, src, dst)
        else:
            digest, size = _sha256_file(src)
            self._io(self._uri(dst), self.fs.put_file, src, dst)
        return FileEntry(sha256=digest, bytes=size)

    @staticmethod
    def _local_copy(src: str, dst: str) -> tuple[str, int]:
        # One pass: the checksum is of exactly the bytes written.
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        h = hashlib.sha256()
        n = 0
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while block := fi.read(_CHUNK):
                h.update(block)
                fo.write(block)
                n += len(block)
            fo.flush()
            os.fsync(fo.fileno())
        return h.hexdigest(), n

    # ------------------------------------------------------------------ verified reads
    def _verify(self, uri: str, entry: FileEntry, data: bytes) -> None:
        if len(data) != entry.bytes:
            raise ArtifactCorrupt(f"{uri}: size {len(data)} bytes, manifest says {entry.bytes}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise ArtifactCorrupt(f"{uri}: sha256 {digest[:16]}..., manifest says {entry.sha256[:16]}...")

    def _read_verified(self, manifest: Manifest, rel: str) -> bytes:
        _check_relpath("file name in manifest", rel)
        path = self._join(self._mdir(manifest), *rel.split("/"))
        uri = self._uri(path)
        try:
            data = self._cat(path)
        except FileNotFoundError as e:
            raise ArtifactCorrupt(f"{uri}: file listed in the manifest is missing") from e
        self._verify(uri, manifest.files[rel], data)
        return data

    def read_bytes(self, manifest: Manifest, name: str) -> bytes:
        """The verified bytes of one file of a committed artifact."""
        rel = self._resolve(manifest, name)
        if rel not in manifest.files:
            raise StoreError(f"{self.uri(manifest, name)} is a folder; use fetch_dir")
        return self._read_verified(manifest, rel)

    def read_table(self, manifest: Manifest, name: str) -> pa.Table:
        """A verified Parquet table ("rollouts" or "rollouts.parquet")."""
        rel = self._resolve(manifest, name)
        entry = manifest.files.get(rel)
        if entry is None or entry.rows is None:
            raise StoreError(f"{self.uri(manifest, name)} is not a table of the artifact")
        data = self._read_verified(manifest, rel)
        uri = self.uri(manifest, rel)
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as e:
            raise ArtifactCorrupt(f"{uri}: not readable as Parquet: {e}") from e
        if table.num_rows != entry.rows:
            raise ArtifactCorrupt(f"{uri}: {table.num_rows} rows, manifest says {entry.rows}")
        return table

    def fetch_dir(self, manifest: Manifest, name: str, local_dir: str) -> str:
        """Download every file under ``<name>/`` into ``local_dir`` (each verified); returns its path.

        Files already present locally with the right checksum are kept (a warm cache).
        """
        prefix = name.rstrip("/") + "/"
        rels = sorted(r for r in manifest.files if r.startswith(prefix))
        if not rels:
            raise StoreError(f"artifact {self._uri(self._mdir(manifest))} has no folder {name!r}")
        local_dir = os.path.abspath(local_dir)
        for rel in rels:
            _check_relpath("file name in manifest", rel)
            entry = manifest.files[rel]
            dst = os.path.join(local_dir, *rel[len(prefix) :].split("/"))
            if (
                os.path.isfile(dst)
                and os.path.getsize(dst) == entry.bytes
                and _sha256_file(dst)[0] == entry.sha256
            ):
                continue
            src = self._join(self._mdir(manifest), *rel.split("/"))
            uri = self._uri(src)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            tmp = f"{dst}.part-{uuid.uuid4().hex}"
            try:
                try:
                    self._refuse_links(src)
                    if self._local:
                        self._io(uri, shutil.copyfile, src, tmp)
                    else:
                        self._io(uri, self.fs.get_file, src, tmp)
                except FileNotFoundError as e:
                    raise ArtifactCorrupt(f"{uri}: file listed in the manifest is missing") from e
                digest, size = _sha256_file(tmp)
                if size != entry.bytes:
                    raise ArtifactCorrupt(f"{uri}: size {size} bytes, manifest says {entry.bytes}")
                if digest != entry.sha256:
                    raise ArtifactCorrupt(
                        f"{uri}: sha256 {digest[:16]}..., manifest says {entry.sha256[:16]}..."
                    )
                os.replace(tmp, dst)  # only verified bytes ever carry the final name
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return local_dir

    def prune(self, manifest: Manifest, prefixes: tuple[str, ...], meta: dict) -> Manifest:
        """Drop the files under ``prefixes`` from a committed artifact, keeping its id (what later stages name as
        their input) and adding ``meta``. The smaller manifest replaces the old one first (atomically), then the
        files go: a reader that opens the manifest afterwards is never shown a missing file."""
        folder = self._mdir(manifest)
        gone = sorted(rel for rel in manifest.files if rel.startswith(prefixes))
        if not gone:
            return manifest
        m = manifest.model_copy(
            update={
                "files": {rel: e for rel, e in manifest.files.items() if rel not in gone},
                "meta": {**manifest.meta, **meta},
                _SIGNATURE: None,
            }
        )
        key = _hmac_key()
        if key is not None:
            m = m.model_copy(update={_SIGNATURE: _sign(key, json.loads(m.model_dump_json(exclude={_SIGNATURE})))})
        path = self._join(folder, MANIFEST)
        data = m.model_dump_json(indent=2).encode()
        if self._local:
            self._io(self._uri(path), self._local_replace, path, data)
        else:  # an object store's PUT replaces the whole object at once
            self._write(path, data)
        for rel in gone:
            self._rm(self._join(folder, *rel.split("/")))
        return m

    @staticmethod
    def _local_replace(path: str, data: bytes) -> None:
        tmp = f"{path}.prune-{uuid.uuid4().hex}"  # a MANIFEST-prefixed temp: a concurrent commit never sweeps it
        try:
            ArtifactStore._local_write(tmp, data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # ------------------------------------------------------------------ delete / list
    def delete(self, run: str, iteration: int | None, stage: str, version: str = MAIN) -> None:
        """Uncommit (manifest first, so readers never see a half-deleted artifact), then remove files."""
        folder = self._dir(run, iteration, stage, version)
        self._rm(self._join(folder, MANIFEST))
        self._rm(folder, recursive=True)

    def iterations(self, run: str) -> list[int]:
        """Iteration numbers with at least one committed artifact, ascending."""
        pattern = self._join(self._base, _check_name("run name", run), "iter-*", "*", MANIFEST)
        found = set()
        for p in self._glob(pattern):
            m = _ITER.match(p.replace(os.sep, "/").split("/")[-3])
            if m:
                found.add(int(m.group(1)))
        return sorted(found)

    def runs(self) -> list[str]:
        """Names of the runs under this root (those with a recorded config), sorted."""
        found = self._glob(self._join(self._base, "*", "run.json"))
        return sorted(p.replace(os.sep, "/").split("/")[-2] for p in found)

    def versions(self, run: str, iteration: int | None, stage: str) -> list[str]:
        """Committed versions of one stage's artifact: "main" first, then the others sorted."""
        parent = self._join(self._base, *self._rel_dir(run, iteration, stage, MAIN)[:-1])
        found = set()
        for pattern in (self._join(parent, stage, MANIFEST), self._join(parent, f"{stage}@*", MANIFEST)):
            for p in self._glob(pattern):
                folder = p.replace(os.sep, "/").split("/")[-2]
                if folder == stage:
                    found.add(MAIN)
                elif folder.startswith(stage + "@"):
                    found.add(folder[len(stage) + 1 :])
        return sorted(found, key=lambda v: (v != MAIN, v))

    # ------------------------------------------------------------------ run documents
    def _json_path(self, run: str, name: str) -> str:
        _check_name("run name", run)
        _check_name("document name", name)
        return self._join(self._base, run, name if name.endswith(".json") else f"{name}.json")

    def put_json(self, run: str, name: str, obj: dict, *, exclusive: bool = False) -> None:
        """Write ``<root>/<run>/<name>.json``; with ``exclusive``, only if it does not exist yet."""
        path = self._json_path(run, name)
        key = _hmac_key()
        if key is not None:
            obj = {**obj, f"_{_SIGNATURE}": _sign(key, json.loads(json.dumps(obj)))}
        data = json.dumps(obj, indent=2, sort_keys=True).encode()
        if exclusive:
            try:
                self._create_exclusive(path, data)
            except FileExistsError as e:
                raise CommitConflict(f"{self._uri(path)} already exists") from e
        elif self._local:
            # temp + rename: a reader sees the old or the new document, never half of one.
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self._write(tmp, data)
            self._io(self._uri(path), os.replace, tmp, path)
        else:
            self._write(path, data)  # an object PUT is atomic

    def get_json(self, run: str, name: str) -> dict | None:
        """The document, or None when it does not exist."""
        path = self._json_path(run, name)
        try:
            raw = self._cat(path)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise ArtifactCorrupt(f"{self._uri(path)} is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise ArtifactCorrupt(f"{self._uri(path)} is not a JSON object")
        signature = doc.pop(f"_{_SIGNATURE}", None)
        key = _hmac_key()
        if key is not None:
            _check_signature(key, self._uri(path), doc, signature)
        return doc

    def delete_json(self, run: str, name: str) -> None:
        """Remove the document; missing is fine."""
        self._rm(self._json_path(run, name))
