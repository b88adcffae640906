"""Where a snapshot's files live, what its manifest says, and how to check a name (chapter 8, s. 1).

A snapshot is published under an immutable id in a checkpoint folder `root`:

    root/step-000000040/rank0.bin          the shards (any names, one path component each)
    root/step-000000040/rank1.bin
    root/step-000000040.manifest.json      published last; its presence is the commit

The manifest is JSON with exactly these keys (chapter 8 and lab 8 use the same format):

    {"format": "labkit-snapshot/1",
     "snapshot_id": "step-000000040",
     "shards": [{"path": "step-000000040/rank0.bin", "bytes": 262144, "sha256": "9f2c..."}, ...],
     "metadata": {...}}                    # anything JSON can hold (step, world size, hashes, ...)

Shard paths are relative to `root` and must stay inside `root/<snapshot_id>/`. Ids written by
`snapshot_id(step)` sort by step as plain strings, so "newest" is the largest id.

Nothing here imports torch: a crash-trial process imports this module in milliseconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

FORMAT = "labkit-snapshot/1"
MANIFEST_SUFFIX = ".manifest.json"
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
MANIFEST_KEYS = ("format", "snapshot_id", "shards", "metadata")
SHARD_KEYS = ("path", "bytes", "sha256")


class CheckpointError(ValueError):
    """A snapshot cannot be published or loaded as asked; the message says what and why."""


def snapshot_id(step: int) -> str:
    """The id of the snapshot taken after `step` optimizer steps: 'step-000000040'."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10 ** 9:
        raise CheckpointError(f"step must be an int in [0, 1e9), got {step!r}")
    return f"step-{step:09d}"


def check_name(name, what: str = "snapshot id") -> str:
    """`name` if it is one safe path component, else CheckpointError saying why.

    Refused: anything but a str, '', '.', '..', a path separator, a leading dot or dash, NUL,
    more than 100 characters. One component means a name can never reach outside its folder.
    """
    if not isinstance(name, str):
        raise CheckpointError(f"{what} must be a str, got {type(name).__name__} {name!r}")
    if "/" in name or "\\" in name or os.sep in name:
        raise CheckpointError(f"{what} {name!r} contains a path separator: an id is one path "
                              "component, so that it cannot point outside the checkpoint folder")
    if not ID_PATTERN.fullmatch(name) or ".." in name:
        raise CheckpointError(f"{what} {name!r} is not a plain name: use letters, digits, '_', "
                              "'-' and '.', starting with a letter or digit (e.g. "
                              f"{snapshot_id(40)!r})")
    return name


def manifest_path(root, snapshot: str) -> str:
    """root/<snapshot>.manifest.json"""
    return os.path.join(os.fspath(root), check_name(snapshot) + MANIFEST_SUFFIX)


def shard_folder(root, snapshot: str) -> str:
    """root/<snapshot>/: where the snapshot's shards are written."""
    return os.path.join(os.fspath(root), check_name(snapshot))


def published_ids(root) -> list[str]:
    """Ids that have a manifest under root (published, not yet verified), oldest first."""
    found = []
    for name in os.listdir(os.fspath(root)):
        if name.endswith(MANIFEST_SUFFIX):
            snapshot = name[:-len(MANIFEST_SUFFIX)]
            if ID_PATTERN.fullmatch(snapshot) and ".." not in snapshot:
                found.append(snapshot)
    return sorted(found)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_folder(path) -> None:
    """Make a folder's entries (a new file, a new link) durable: fsync the folder itself."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def inside(root, relative: str, snapshot: str) -> str:
    """The real path of shard `relative` (as a manifest names it), if it stays inside
    root/<snapshot>/; CheckpointError otherwise (absolute paths, '..', symbolic links out)."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative):
        raise CheckpointError(f"snapshot {snapshot!r}: shard path {relative!r} must be a relative "
                              "path inside the checkpoint folder")
    folder = os.path.realpath(shard_folder(root, snapshot))
    path = os.path.realpath(os.path.join(os.fspath(root), relative))
    if os.path.commonpath([folder, path]) != folder or path == folder:
        raise CheckpointError(f"snapshot {snapshot!r}: shard path {relative!r} points outside "
                              f"{snapshot}/ in the checkpoint folder; refusing to read it")
    return path


def parse_manifest(text, snapshot: str) -> dict:
    """The manifest of `snapshot` from its JSON text, with its structure checked
    (CheckpointError on anything malformed). Files are not looked at: see store.verify."""
    try:
        manifest = json.loads(text)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"snapshot {snapshot!r}: the manifest is not valid JSON ({error}); "
                              "a torn or foreign file") from None
    if not isinstance(manifest, dict) or sorted(manifest) != sorted(MANIFEST_KEYS):
        got = sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"snapshot {snapshot!r}: manifest keys {got}, expected "
                              f"{sorted(MANIFEST_KEYS)}")
    if manifest["format"] != FORMAT or manifest["snapshot_id"] != snapshot:
        raise CheckpointError(f"snapshot {snapshot!r}: manifest says format "
                              f"{manifest['format']!r}, id {manifest['snapshot_id']!r}; expected "
                              f"{FORMAT!r} and {snapshot!r}")
    shards = manifest["shards"]
    if not isinstance(shards, list) or not shards:
        raise CheckpointError(f"snapshot {snapshot!r}: the manifest lists no shard")
    for entry in shards:
        if not isinstance(entry, dict) or sorted(entry) != sorted(SHARD_KEYS) \
                or not isinstance(entry["bytes"], int) or not isinstance(entry["sha256"], str):
            raise CheckpointError(f"snapshot {snapshot!r}: malformed shard entry {entry!r}; "
                                  f"expected keys {list(SHARD_KEYS)}")
    if len({entry["path"] for entry in shards}) != len(shards):
        raise CheckpointError(f"snapshot {snapshot!r}: the manifest lists a shard twice")
    return manifest
