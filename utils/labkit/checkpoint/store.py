"""Publishing a sharded snapshot so that no crash leaves a torn one to be loaded (ch. 8, s. 1-2).

The protocol, in the order the calls happen in a distributed save:

    entry = write_shard(root, sid, "rank0.bin", data)  # every rank: write, fsync file and folder
    ...                                                # the ranks agree (gather the entries)
    commit(root, sid, entries, metadata)               # one rank: temp manifest, fsync, link
    snapshot = load_latest(root)                       # anyone, later: newest that verifies

- A snapshot id is immutable: `commit` publishes with `os.link(temp, final)`, which fails with
  FileExistsError when `final` exists, so of two concurrent commits of one id exactly one wins
  (a rename would silently replace the winner).
- The manifest is published only after every shard is durable (fsynced, and its folder fsynced),
  and it is itself fsynced before the link: a machine that loses power never comes back with a
  manifest naming bytes that never reached the disk.
- Readers trust nothing but a manifest whose shards all match their sizes and SHA-256; the hash
  is computed over the very bytes handed back (no check-then-read gap).

`commit_folder(root, sid, metadata)` publishes files another writer put under root/<sid>/ (DCP's,
in chapter 8, section 3), so that any sharded format gets the same commit.

An object store has no link and no rename: there, publication is a conditional put of the
manifest (`If-None-Match: *` on S3, `ifGenerationMatch=0` on Google Cloud Storage) issued after
every shard's put has returned. The course explains it; this module is the POSIX version.

`save(root, sid, shards, metadata)` is the whole protocol in one process (write every shard, then
commit): lab 8's crash trials save with it. Lab 8, task 1 (a retention policy) builds on this
module; chapter 9 imports it.
"""
from __future__ import annotations

import json
import os
import tempfile

from labkit.checkpoint.layout import (FORMAT, CheckpointError, check_name, fsync_folder, inside,
                                      manifest_path, parse_manifest, published_ids, sha256_bytes,
                                      sha256_file, shard_folder)

CHUNK = 1 << 16          # bytes per os.write: a crash harness can stop a write between chunks


def _write_all(fd: int, data: bytes, chunk: int = CHUNK) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:chunk])
        view = view[written:]


def write_shard(root, snapshot: str, name: str, data: bytes) -> dict:
    """Write one shard durably to root/<snapshot>/<name>; return its manifest entry
    {"path", "bytes", "sha256"} (what the ranks gather before the commit).

    FileExistsError if the snapshot is already published (a published snapshot never changes).
    A file left by an unpublished, crashed attempt is replaced: nobody could have loaded it.
    """
    check_name(name, "shard name")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"shard data must be bytes, got {type(data).__name__}")
    if os.path.exists(manifest_path(root, snapshot)):
        raise FileExistsError(f"snapshot {snapshot!r} is already published in {root}; a "
                              "published snapshot is never written again: use a new id")
    folder = shard_folder(root, snapshot)
    created = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, bytes(data))
        os.fsync(fd)                           # the bytes are on the disk ...
    finally:
        os.close(fd)
    fsync_folder(folder)                       # ... and so is the name that finds them
    if created:
        fsync_folder(root)                     # ... and the folder's own name
    return {"path": f"{snapshot}/{name}", "bytes": len(data), "sha256": sha256_bytes(bytes(data))}


def commit(root, snapshot: str, shards: list, metadata: dict, rehash: bool = True) -> str:
    """Publish root/<snapshot>.manifest.json listing `shards` (the entries write_shard returned,
    gathered from every rank). Returns the manifest's path.

    Order: check every shard (inside the folder, present, right size; with `rehash`, right
    SHA-256 too), write the manifest to a temp file, fsync it, link it to its final name (the
    commit point: FileExistsError if that name exists), fsync the folder, remove the temp name.
    """
    target = manifest_path(root, snapshot)
    if not isinstance(shards, (list, tuple)) or not shards:
        raise CheckpointError(f"snapshot {snapshot!r}: commit needs the list of shard entries "
                              f"write_shard returned, got {shards!r}")
    for entry in shards:
        if not isinstance(entry, dict) or sorted(entry) != ["bytes", "path", "sha256"]:
            raise CheckpointError(f"snapshot {snapshot!r}: malformed shard entry {entry!r}")
        path = inside(root, entry["path"], snapshot)
        if not os.path.isfile(path):
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} is missing; "
                                  "every rank must have written its shard before the commit")
        if os.path.getsize(path) != entry["bytes"]:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} has "
                                  f"{os.path.getsize(path)} bytes, its writer reported "
                                  f"{entry['bytes']}")
        if rehash and sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} changed after "
                                  "its writer hashed it")
    if os.path.exists(target):
        raise FileExistsError(f"snapshot {snapshot!r} is already published: {target}")
    manifest = {"format": FORMAT, "snapshot_id": snapshot, "shards": list(shards),
                "metadata": metadata}
    try:
        text = json.dumps(manifest, sort_keys=True).encode()
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"snapshot {snapshot!r}: metadata must be JSON data ({error})") \
            from None
    fd, temp = tempfile.mkstemp(dir=os.fspath(root), prefix=f".{snapshot}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, text)
            os.fsync(fd)                       # the manifest's bytes are durable ...
        finally:
            os.close(fd)
        os.link(temp, target)                  # ... before its name appears: the commit point
    finally:
        os.unlink(temp)
    fsync_folder(root)                         # the new name survives a power cut
    return target


def commit_folder(root, snapshot: str, metadata: dict) -> str:
    """Publish everything already written under root/<snapshot>/ (another writer's files, e.g.
    DCP's `__0_0.distcp` and `.metadata`): one manifest entry per file, hashed here. Call it on
    one rank after every rank's writer returned (chapter 8, section 3: DCP with the commit on
    top). The files must be durable already (DCP fsyncs its data files)."""
    folder = shard_folder(root, snapshot)
    entries = []
    for here, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(here, name)
            entries.append({"path": os.path.relpath(path, os.fspath(root)).replace(os.sep, "/"),
                            "bytes": os.path.getsize(path), "sha256": sha256_file(path)})
    fsync_folder(folder)
    return commit(root, snapshot, entries, metadata, rehash=False)


def _read_manifest(root, snapshot: str) -> dict:
    try:
        with open(manifest_path(root, snapshot), "rb") as stream:
            text = stream.read()
    except FileNotFoundError:
        raise CheckpointError(f"snapshot {snapshot!r} is not published in {root} (no "
                              "manifest)") from None
    return parse_manifest(text, snapshot)


def verify(root, snapshot: str) -> dict:
    """The manifest of `snapshot`, after checking that every shard it lists is inside the
    folder, present, of the right size and SHA-256. CheckpointError naming the first problem."""
    manifest = _read_manifest(root, snapshot)
    for entry in manifest["shards"]:
        path = inside(root, entry["path"], snapshot)
        if not os.path.isfile(path):
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} is missing")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} has {size} "
                                  f"bytes, the manifest says {entry['bytes']} (truncated?)")
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} does not "
                                  "match its SHA-256 (corrupted or overwritten)")
    return manifest


def load(root, snapshot: str) -> dict:
    """{"snapshot_id", "metadata", "shards": {name: bytes}} of a verified snapshot; the checks
    of `verify` run on the bytes returned (read once, hashed as read)."""
    manifest = _read_manifest(root, snapshot)
    shards = {}
    for entry in manifest["shards"]:
        path = inside(root, entry["path"], snapshot)
        try:
            with open(path, "rb") as stream:
                data = stream.read()
        except FileNotFoundError:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} is "
                                  "missing") from None
        if len(data) != entry["bytes"] or sha256_bytes(data) != entry["sha256"]:
            raise CheckpointError(f"snapshot {snapshot!r}: shard {entry['path']!r} has "
                                  f"{len(data)} bytes that do not match the manifest "
                                  f"({entry['bytes']} bytes and its SHA-256)")
        shards[os.path.relpath(path, os.path.realpath(shard_folder(root, snapshot)))] = data
    return {"snapshot_id": snapshot, "metadata": manifest["metadata"], "shards": shards}


def save(root, snapshot: str, shards: dict, metadata: dict) -> str:
    """One process's whole save: write_shard for every {name: bytes} of `shards`, then commit.
    Returns the manifest's path."""
    entries = [write_shard(root, snapshot, name, data) for name, data in shards.items()]
    return commit(root, snapshot, entries, metadata)


def load_latest(root) -> dict | None:
    """The newest snapshot under root that loads and verifies, or None. Newer ones that fail
    are skipped; their ids and reasons are in the result's "skipped" list."""
    skipped = []
    for snapshot in reversed(published_ids(root)):
        try:
            found = load(root, snapshot)
        except CheckpointError as error:
            skipped.append((snapshot, str(error)))
            continue
        found["skipped"] = skipped
        return found
    return None
