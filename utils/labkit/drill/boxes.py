"""Leitner boxes, one per question, kept in a small JSON file.

    store = Store()                          # ~/.labkit/drill.json, or $LABKIT_DRILL_FILE
    store = Store("/tmp/my-drill.json")      # any path

A question starts in box 1. Answered right, it moves up one box (at most 5); answered wrong or
skipped, it goes back to box 1. A question in box b is due once every 1, 2, 4, 8, 16 sessions
(b = 1 .. 5): what you miss comes back next session, what you know comes back rarely. A numeric
drill is one question whatever numbers it draws: it is the derivation that is learnt.

The file is written after every answer (to a temporary file, then renamed over the old one, so an
interrupted write never leaves half a file), under a lock, merged with what is on disk: a notebook
and a terminal drilling at the same time keep each other's answers. A file that cannot be read is
moved aside, not overwritten; a file that cannot be written leaves the drill working without
saving. Either way `store.notes` says what happened.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:              # not POSIX: saves are not locked against a second session
    fcntl = None

ENVIRONMENT = "LABKIT_DRILL_FILE"
DEFAULT = Path("~") / ".labkit" / "drill.json"
BOXES = 5
EVERY = {1: 1, 2: 2, 3: 4, 4: 8, 5: 16}      # a box-b question is due once every EVERY[b] sessions
VERSION = 1


def default_path() -> Path:
    return Path(os.environ.get(ENVIRONMENT) or DEFAULT).expanduser()


class Store:
    def __init__(self, path=None):
        self.path = Path(path).expanduser() if path else default_path()
        self.notes: list = []
        self.data = self._load()
        self.session = self.data["sessions"] + 1    # this session's number, saved on first answer
        self._can_save = True
        self._mine: set = set()                      # questions answered in this session

    # ---- the file ----

    def _empty(self) -> dict:
        return {"version": VERSION, "sessions": 0, "items": {}, "history": []}

    def _load(self) -> dict:
        if not self.path.exists():
            return self._empty()
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or not isinstance(data.get("items"), dict):
                raise ValueError("not a drill file (no 'items' table)")
            data.setdefault("sessions", 0)
            data.setdefault("history", [])
            return data
        except (OSError, ValueError) as exc:
            aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
            try:
                self.path.rename(aside)
                where = f"moved it to {aside}"
            except OSError:
                where = "left it where it is"
            self.notes.append(f"Could not read {self.path} ({exc}); {where} and started afresh.")
            return self._empty()

    @contextlib.contextmanager
    def _locked(self):
        if fcntl is None:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _merge_from_disk(self) -> None:
        """Take what other sessions saved meanwhile; this session's own answers win."""
        try:
            disk = json.loads(self.path.read_text(encoding="utf-8"))
            items = dict(disk["items"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        items.update({key: self.data["items"][key] for key in self._mine})
        history = {h.get("session"): h for h in disk.get("history", [])}
        history.update({h.get("session"): h for h in self.data["history"]
                        if h.get("session") == self.session})
        self.data = {**self.data, "items": items,
                     "sessions": max(int(disk.get("sessions", 0)), self.data["sessions"]),
                     "history": sorted(history.values(), key=lambda h: h.get("session", 0))}

    def save(self) -> bool:
        """Write the file atomically; False (and a note, once) where it cannot be written."""
        if not self._can_save:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                self._merge_from_disk()
                self.data["sessions"] = max(self.data["sessions"], self.session)
                handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".drill-")
                with os.fdopen(handle, "w", encoding="utf-8") as out:
                    json.dump(self.data, out, indent=1, sort_keys=True)
                os.replace(temporary, self.path)
            return True
        except OSError as exc:
            self._can_save = False
            self.notes.append(f"Could not save progress to {self.path} ({exc}); the drill goes "
                              "on without saving. Pass another file with --file (terminal) or "
                              "path= (notebook).")
            return False

    # ---- boxes ----

    def item(self, key: str) -> dict:
        return self.data["items"].get(key, {})

    def box(self, key: str) -> int:
        return self.item(key).get("box", 1)

    def due(self, key: str) -> bool:
        """Never seen, or at least EVERY[box] sessions since it was last asked."""
        item = self.item(key)
        if not item:
            return True
        return self.session - item.get("last_session", 0) >= EVERY[item.get("box", 1)]

    def record(self, key: str, topic: str, right: bool) -> tuple:
        """Move a question between boxes and save; returns (box before, box after)."""
        item = self.data["items"].setdefault(key, {"box": 1, "seen": 0, "right": 0,
                                                   "topic": topic})
        before = item["box"]
        item["box"] = min(before + 1, BOXES) if right else 1
        item["seen"] += 1
        item["right"] += int(bool(right))
        item["topic"] = topic
        item["last_session"] = self.session
        self._mine.add(key)
        self.save()
        return before, item["box"]

    def finish(self, summary: dict) -> None:
        """Keep a line of history for this session (the last 100 sessions)."""
        if not summary.get("asked"):
            return
        line = {"session": self.session, "time": int(time.time()), "asked": summary["asked"],
                "right": summary["right"], "by_topic": summary["by_topic"]}
        history = [h for h in self.data["history"] if h.get("session") != self.session]
        self.data["history"] = (history + [line])[-100:]
        self.save()

    # ---- what the summary reads ----

    def topic_stats(self) -> dict:
        """{topic: {"seen", "right", "questions", "mean_box"}} over every session."""
        stats: dict = {}
        for item in self.data["items"].values():
            s = stats.setdefault(item.get("topic", "?"), {"seen": 0, "right": 0, "questions": 0,
                                                           "boxes": 0})
            s["seen"] += item.get("seen", 0)
            s["right"] += item.get("right", 0)
            s["questions"] += 1
            s["boxes"] += item.get("box", 1)
        for s in stats.values():
            s["mean_box"] = s.pop("boxes") / s["questions"]
        return stats

    def weakest(self, k: int = 3) -> list:
        """The k topics most in need of practice: [(topic, right, seen, mean box)], worst first.
        Ranked by (right + 1) / (seen + 2), so one lucky answer does not make a topic strong."""
        ranked = sorted(((t, s["right"], s["seen"], s["mean_box"])
                         for t, s in self.topic_stats().items() if s["seen"]),
                        key=lambda r: ((r[1] + 1) / (r[2] + 2), r[3], r[0]))
        return ranked[:k]

    def box_counts(self) -> dict:
        counts = {b: 0 for b in range(1, BOXES + 1)}
        for item in self.data["items"].values():
            counts[item.get("box", 1)] += 1
        return counts
