"""Chapter 8, section 3: where torch.distributed.checkpoint (DCP) put each key's bytes.

`key_files(folder)` reads DCP's own `.metadata` (written by rank 0 after the save) and returns,
for every saved tensor key, the data file holding its bytes (`__<rank>_0.distcp`, rank = the
writer) and their length. `file_sizes(folder)` lists the data files' sizes from the OS. Neither
predicts anything: the chapter predicts the assignment from DCP's dedup rule
(`torch/distributed/checkpoint/_dedup_save_plans.py`) and compares with what these read.

`writers(folder)` goes one level finer: the writer of every saved *piece*, keyed by (key, offsets)
(a plain tensor is one piece at offset 0; a DTensor has one per shard). `check_writers(folder,
predicted)` is the chapter's checker: it compares a predicted writer per key (or per piece) with
what `.metadata` says, and names every key where they differ.

`quiet()` silences what DCP prints on the expected refusals of the crash trials (section 3): its
loader logs each failed metadata read with a full traceback on the *root* logger
(`state_dict_loader.py`: `logger = logging.getLogger()`, twice per rank per refused load), and
its writer warns on every save into an existing folder. The refusal itself still raises; the
chapter shows it as one line.
"""
import contextlib
import logging
import os
import re
import warnings

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


def writers(folder):
    """{(key, offsets): writer rank} for every piece DCP's `.metadata` lists, in its order. A
    plain (replicated) tensor is one piece at offsets (0, ...); a DTensor saved as Shard(0) on P
    ranks is P pieces; a non-tensor value (saved as pickled bytes) has offsets None."""
    from torch.distributed.checkpoint import FileSystemReader
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder} has no .metadata: not a finished DCP save (dcp.save "
                                "writes it last, on rank 0)")
    metadata = FileSystemReader(folder).read_metadata()
    return {(index.fqn, None if index.offset is None else tuple(index.offset)):
            writer_rank(info.relative_path) for index, info in metadata.storage_data.items()}


def check_writers(folder, predicted):
    """Compare predicted writers with the ones DCP's `.metadata` names.

    predicted: {key: rank} for a key saved as one piece (a plain tensor), or
    {(key, offsets): rank} for one piece of a sharded tensor. Returns [(key, predicted rank,
    observed rank), ...] in the order of `predicted`. Raises ValueError naming every key whose
    writer differs and every key the save does not hold."""
    found = writers(folder)
    by_key = {}
    for (fqn, offsets), rank in found.items():
        by_key.setdefault(fqn, {})[offsets] = rank
    rows, wrong = [], []
    for key, rank in predicted.items():
        if isinstance(key, tuple):
            observed = found.get((key[0], tuple(key[1])))
        else:
            pieces = by_key.get(key, {})
            if len(set(pieces.values())) > 1:
                raise ValueError(f"key {key!r} is split over ranks {sorted(set(pieces.values()))}"
                                 ": a sharded tensor; predict each piece as (key, offsets)")
            observed = next(iter(pieces.values()), None)
        if observed is None:
            raise ValueError(f"{key!r} is not in {folder}/.metadata (saved keys: "
                             f"{sorted(by_key)}); was it in every rank's state dict?")
        rows.append((key, rank, observed))
        if observed != rank:
            wrong.append(f"{key!r}: predicted rank {rank}, written by rank {observed}")
    if wrong:
        raise ValueError("DCP's dedup put these keys elsewhere: " + "; ".join(wrong) + ". Check "
                         "the walk: every item counts (replicated or not), in the order first "
                         "met (rank 0's plan first), each with the bytes of its whole tensor")
    return rows


def file_sizes(folder):
    """{writer rank: size in bytes of its .distcp file}, from os.stat."""
    return {writer_rank(name): os.path.getsize(os.path.join(folder, name))
            for name in sorted(os.listdir(folder)) if _DATA_FILE.search(name)}


class _DropDCPRecords(logging.Filter):
    def filter(self, record):
        return "torch/distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


@contextlib.contextmanager
def quiet():
    """DCP's log records (any logger) and its overwrite UserWarning off for the block; nothing
    else is hidden, and every exception still propagates."""
    drop = _DropDCPRecords()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in
                                       list(logging.root.manager.loggerDict)
                                       if name.startswith("torch.distributed.checkpoint")]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint in",
                                    category=UserWarning)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def refusal(error, folder=None):
    """One line for an expected refusal: the exception's name, and for DCP's CheckpointException
    (which wraps one exception per failed rank) the ranks and the first one's cause; `folder`,
    when given, is written as <folder>."""
    name = type(error).__name__
    short = (lambda text: text.replace(str(folder), "<folder>")) if folder else (lambda text: text)
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = next(iter(failures.values()))[0]
        while getattr(cause, "__cause__", None) is not None or (
                isinstance(cause, RuntimeError) and cause.__context__ is not None):
            cause = cause.__cause__ or cause.__context__
        first = (short(str(cause)).strip().splitlines() or [""])[0]
        return f"{name} on ranks {sorted(failures)}: {type(cause).__name__}: {first[:100]}"
    text = short(str(error)).strip().splitlines()
    return f"{name}: {text[0][:100]}" if text else name
