"""Chapter 8, section 3: where torch.distributed.checkpoint (DCP) put each key's bytes.

`key_files(folder)` reads DCP's own `.metadata` (written by rank 0 after the save) and returns,
for every saved tensor key, the data file holding its bytes (`__<rank>_0.distcp`, rank = the
writer) and their length. `file_sizes(folder)` lists the data files' sizes from the OS. Neither
predicts anything: the chapter predicts the assignment from DCP's dedup rule
(`torch/distributed/checkpoint/_dedup_save_plans.py`) and compares with what these read.
"""
import os
import re

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def writer_rank(relative_path):
    """The rank whose file `relative_path` is (DCP names them `__<rank>_<n>.distcp`)."""
    found = _DATA_FILE.search(relative_path)
    if found is None:
        raise ValueError(f"{relative_path!r} is not a DCP data file name (expected "
                         "'__<rank>_<n>.distcp'); was the folder written by FileSystemWriter?")
    return int(found.group(1))


def key_files(folder):
    """{key: (writer rank, relative path, bytes)} for every tensor key in DCP's `.metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} has no .metadata: not a finished DCP save (dcp.save "
                                "writes it last, on rank 0)")
    metadata = FileSystemReader(folder).read_metadata()
    out = {}
    for index, info in metadata.storage_data.items():
        rank = writer_rank(info.relative_path)
        if index.fqn in out and out[index.fqn][0] != rank:
            raise ValueError(f"key {index.fqn!r} is split over ranks {out[index.fqn][0]} and "
                             f"{rank}: a sharded tensor, not a replicated one")
        length = out.get(index.fqn, (rank, info.relative_path, 0))[2] + info.length
        out[index.fqn] = (rank, info.relative_path, length)
    return out


def file_sizes(folder):
    """{writer rank: size in bytes of its .distcp file}, from os.stat."""
    return {writer_rank(name): os.path.getsize(os.path.join(folder, name))
            for name in sorted(os.listdir(folder)) if _DATA_FILE.search(name)}
