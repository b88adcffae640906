"""Kernel side: read each rank's stdout and stderr pipes and show the lines, labelled by rank.

The kernel's main thread reads the pipes while it waits for a call to finish (no reader threads:
nothing to leak), so the lines appear live in the cell, in order per rank, and as plain text in
a headless run. A rank writes a marker to both pipes after each task; a call returns only once
both markers are read, so no line of a call can turn up in a later cell.
"""

import os
import sys

MARKER_START = b"\x1elabkit-done:"
MARKER_END = b"\x1e\n"
KEPT_BYTES = 8 << 20        # text kept per rank between two `take_lines` (a call's output)
LINE_BYTES = 64 << 10       # a line longer than this is cut into pieces of this size


class RankOutput:
    """The two output pipes of one rank."""

    def __init__(self, rank, label_width, out_reader, err_reader):
        self.rank = rank
        self.readers = (out_reader, err_reader)   # Connections: keep them to close them
        out_fd, err_fd = out_reader.fileno(), err_reader.fileno()
        for fd in (out_fd, err_fd):
            os.set_blocking(fd, False)   # `drain` reads until the pipe is empty
        self.label = f"[rank {rank:>{label_width}}] "
        self.buffers = {out_fd: bytearray(), err_fd: bytearray()}
        self.kind = {out_fd: "out", err_fd: "err"}
        self.markers = {out_fd: set(), err_fd: set()}
        self.closed = set()
        self.lines = []          # (stream, text) shown since the last `take_lines`
        self.kept = 0            # bytes of text in self.lines: at most KEPT_BYTES
        self.dropped = 0         # lines not kept since the last `take_lines` (too much output)
        self.echo = True
        self.sink = None         # a live per-rank view (labkit.runtime.display), else lines are printed

    def open_fds(self):
        return [fd for fd in self.buffers if fd not in self.closed]

    def complete(self, task_id):
        """Both streams have passed the end of task `task_id` (or are closed)."""
        return all(fd in self.closed or str(task_id) in self.markers[fd] for fd in self.buffers)

    def mark_complete(self, task_id):
        """The rank found its pipes empty at the end of task `task_id`: all its output has been
        read; show a last line left without a newline."""
        for fd, buffer in self.buffers.items():
            self.markers[fd].add(str(task_id))
            if buffer and fd not in self.closed:
                self._emit(fd, bytes(buffer))
                buffer.clear()

    def drain(self):
        """Read both pipes until empty. A rank writes its end-of-task markers before it replies,
        so once its reply has arrived the markers are already in the pipes."""
        for fd in self.open_fds():
            while fd not in self.closed and self.read(fd):
                pass

    def read(self, fd):
        """Read what is there; return False if nothing was (the pipe is empty or closed)."""
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        buffer = self.buffers[fd]
        if not data:
            self.closed.add(fd)
            if buffer:
                self._emit(fd, bytes(buffer))
                buffer.clear()
            return False
        buffer += data
        self._scan(fd)
        return True

    def _scan(self, fd):
        buffer = self.buffers[fd]
        while True:
            start = buffer.find(MARKER_START)
            text_end = start if start >= 0 else buffer.rfind(b"\n") + 1
            if text_end > 0:
                text = bytes(buffer[:text_end])
                for line in text.splitlines():
                    self._emit(fd, line)
                del buffer[:text_end]
            if start < 0:
                while len(buffer) > LINE_BYTES:          # no newline for a long while: cut it
                    self._emit(fd, bytes(buffer[:LINE_BYTES]))
                    del buffer[:LINE_BYTES]
                return
            end = buffer.find(MARKER_END)
            if end < 0:
                return  # the rest of the marker has not arrived yet
            task_id = buffer[len(MARKER_START):end].decode(errors="replace")
            self.markers[fd].add(task_id)
            del buffer[:end + len(MARKER_END)]

    def _emit(self, fd, raw):
        if len(raw) > LINE_BYTES:                        # one long line: pieces of LINE_BYTES
            for start in range(0, len(raw), LINE_BYTES):
                self._emit(fd, raw[start:start + LINE_BYTES])
            return
        text = raw.decode(errors="replace").rstrip("\r")
        stream = self.kind[fd]
        if self.kept + len(text) <= KEPT_BYTES:          # what a caller reads back is bounded
            self.lines.append((stream, text))
            self.kept += len(text)
        else:
            self.dropped += 1
        if not self.echo:
            return
        if self.sink is not None:
            self.sink(self.rank, text, stream)
        else:
            target = sys.stdout if stream == "out" else sys.stderr
            print(self.label + text, file=target, flush=True)

    def take_lines(self):
        """The lines since the last call, at most KEPT_BYTES of them; a last line says how many
        more there were (they were shown, when echoing, but not kept)."""
        lines, self.lines = self.lines, []
        if self.dropped:
            lines.append(("err", f"[labkit: {self.dropped} more lines of rank {self.rank} not "
                                 f"kept: over {KEPT_BYTES >> 20} MiB of output in one call]"))
        self.kept = self.dropped = 0
        return lines

    def close(self):
        self.closed.update(self.buffers)
        for reader in self.readers:
            reader.close()
