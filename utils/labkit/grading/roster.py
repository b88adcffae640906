"""`labkit import` and `labkit export`: submissions in from a learning platform, feedback out.

    labkit import lab03_memory_and_zero canvas-export/ --roster roster.csv --out subs/lab03 \\
        --deadline 2025-03-07T23:59
    labkit grade lab03_memory_and_zero subs/lab03
    labkit export lab03_memory_and_zero --out returned/lab03 --manifest subs/lab03/manifest.csv

Import. A platform's "download all submissions" is a flat folder (or a .zip) of renamed files:
Canvas `smithjane_12345_67890_lab03_memory_and_zero.ipynb` (sortable name, user id, submission
id; `_LATE_` after the name when late), Moodle `Jane Smith_123_assignsubmission_file_lab03.ipynb`
(full name, participant id; sometimes a folder per student), Blackboard `..._jsmith_attempt_
2025-03-07-23-59-10_...`. Each file is matched to one row of the roster CSV by the columns the
roster has: the student id, login, e-mail, name (or first and last name), and other id columns
(a platform's own user id). A value matches when its words appear in the file's path as whole
words in that order (`jane smith`, `smith jane`), or run together as one word (`smithjane`). A
file that matches no row, or two rows equally well (an id, login or e-mail decides between two
same-named students), is not imported and is reported; so is each roster student with no file.
Two files of one student for one notebook: the newest is kept, the other reported.

Written: OUT/<student_id>/<notebook>.ipynb (what `labkit grade` reads; `--layout nbgrader` gives
OUT/<student_id>/<LAB>/<notebook>.ipynb), OUT/<student_id>/timestamp.txt (nbgrader's format,
what its own autograde reads for late penalties), and OUT/manifest.csv: student_id, notebook,
file, timestamp, timestamp_from (the name, the platform's zip entry or the file's mtime),
late (yes/no against --deadline; yes when the platform marked it late; empty when unknown),
matched_by.

Export, after `labkit grade`: OUT/<student_id>.zip with that student's feedback HTML
(`<LAB>/<notebook>.html`) and OUT/grades.csv (student_id, score, max_score, late) with the
gradebook's scores (the formgrader's manual grades included). OUT is mode 700: it names students.
"""
from __future__ import annotations

import csv
import datetime as dt
import os
import re
import shutil
import sys
import unicodedata
import zipfile

MAX_NOTEBOOK_BYTES = 20 << 20          # what `labkit grade` accepts (pipeline.MAX_NOTEBOOK_BYTES)
STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")   # pipeline._STUDENT_ID
# roster header (lower case, words) -> kind; the first id column found is the student id
COLUMNS = {
    "id": ["student id", "student_id", "sis user id", "id number", "idnumber", "student number",
           "matriculation number", "id"],
    "login": ["login", "login id", "sis login id", "username", "user name", "netid", "user"],
    "email": ["email", "email address", "e mail", "e mail address", "mail"],
    "name": ["name", "student", "full name", "student name"],
    "first": ["first name", "firstname", "given name", "given names"],
    "last": ["last name", "lastname", "surname", "family name"],
}
OTHER_ID = re.compile(r"^(canvas |moodle |platform |participant |user |lms )?(user )?id$")
STRONG = ("id", "login", "email", "other id")
_STAMP = [re.compile(r"(?<!\d)(\d{4})-(\d{2})-(\d{2})[-_T ](\d{2})[-:_.](\d{2})[-:_.](\d{2})"),
          re.compile(r"(?<!\d)(20\d{2})(\d{2})(\d{2})[-_T]?(\d{2})(\d{2})(\d{2})(?!\d)")]


def words(text: str) -> list[str]:
    """Lower-case ASCII words: 'José Smith_12' -> ['jose', 'smith', '12']."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return [w for w in re.split(r"[^a-z0-9]+", ascii_text.lower()) if w]


def _header(name: str) -> str:
    return " ".join(words(name.replace("_", " ")))


def read_roster(path: str) -> tuple[list[dict], dict]:
    """Rows of the roster as {student_id, keys: [(kind, words)], label}, and the columns used."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        table = list(csv.DictReader(f))
    headers = {_header(h): h for h in (table[0].keys() if table else []) if h}
    used = {}
    for kind, names in COLUMNS.items():
        found = next((headers[n] for n in names if n in headers), None)
        if found:
            used[kind] = found
    if "id" not in used:
        raise ValueError(f"roster {path}: no student id column; expected one of "
                         f"{', '.join(repr(n) for n in COLUMNS['id'])}, got "
                         f"{', '.join(repr(h) for h in headers.values()) or 'no header'}")
    others = [h for n, h in headers.items() if OTHER_ID.match(n) and h != used["id"]]
    rows = []
    for number, record in enumerate(table, start=2):
        student = (record.get(used["id"]) or "").strip()
        if not student:
            continue
        if not STUDENT_ID.match(student):
            raise ValueError(f"roster {path} line {number}: student id {student!r} is not a "
                             "folder name `labkit grade` takes (letters, digits, _.@+-; at most "
                             "100); give the roster another id column")
        keys = [("id", words(student))]
        for kind in ("login", "email"):
            value = (record.get(used.get(kind, "")) or "").strip()
            if value:
                keys.append((kind, words(value)))
                if kind == "email" and "@" in value:
                    keys.append((kind, words(value.split("@")[0])))
        keys += [("other id", words(record[h])) for h in others if (record.get(h) or "").strip()]
        first, last = _name_parts(record, used)
        if first and last:
            keys += [("name", first + last), ("name", last + first)]
        label = " ".join(first + last) or student
        rows.append({"student_id": student, "keys": [(k, w) for k, w in keys if w],
                     "label": label})
    return rows, used


def _name_parts(record: dict, used: dict) -> tuple[list, list]:
    if "first" in used and "last" in used:
        return words(record.get(used["first"]) or ""), words(record.get(used["last"]) or "")
    name = (record.get(used.get("name", "")) or "").strip()
    if "," in name:                                     # "Smith, Jane" (Canvas, sortable)
        last, first = name.split(",", 1)
        return words(first), words(last)
    parts = words(name)
    return parts[:-1], parts[-1:]


def matches(key: list, file_words: list) -> bool:
    """`key`'s words appear in the file's words in order, or run together as one of its words."""
    n = len(key)
    if any(file_words[i:i + n] == key for i in range(len(file_words) - n + 1)):
        return True
    return n > 1 and "".join(key) in file_words


def match_file(path_words: list, rows: list) -> tuple[list, str]:
    """The roster rows a file's words match, best evidence first: ([row], matched_by)."""
    found = []
    for row in rows:
        kinds = sorted({kind for kind, key in row["keys"] if matches(key, path_words)})
        if kinds:
            found.append((row, kinds))
    strong = [(r, k) for r, k in found if set(k) & set(STRONG)]
    if len(found) > 1 and len(strong) == 1:             # an id names one of two same-named rows
        found = strong
    return [r for r, _ in found], "+".join(found[0][1]) if len(found) == 1 else ""


def timestamp_in_name(name: str):
    for pattern in _STAMP:
        m = pattern.search(name)
        if m:
            try:
                return dt.datetime(*map(int, m.groups()))
            except ValueError:
                continue
    return None


def parse_deadline(text: str) -> dt.datetime:
    try:
        deadline = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--deadline {text!r}: expected an ISO date and time, e.g. "
                         "2025-03-07T23:59 (this machine's time zone) or "
                         "2025-03-07T23:59+01:00") from None
    return deadline if deadline.tzinfo else deadline.astimezone()


def _export_files(export: str):
    """(relative path, bytes or None when too large, mtime as an aware datetime, where from)."""
    if zipfile.is_zipfile(export):
        with zipfile.ZipFile(export) as archive:
            for info in archive.infolist():
                if info.is_dir():
                    continue
                data = None if info.file_size > MAX_NOTEBOOK_BYTES else archive.read(info)
                yield info.filename, data, dt.datetime(*info.date_time).astimezone(), "zip"
        return
    for folder, dirs, names in os.walk(export):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, export)
            if os.path.islink(path):
                yield rel, b"", None, "link"
                continue
            with open(path, "rb") as f:
                data = f.read(MAX_NOTEBOOK_BYTES + 1)
            when = dt.datetime.fromtimestamp(os.stat(path).st_mtime).astimezone()
            yield rel, (data if len(data) <= MAX_NOTEBOOK_BYTES else None), when, "mtime"


def import_submissions(lab: str, export: str, roster: str, out: str, deadline: str | None = None,
                       course: str | None = None, layout: str = "flat") -> dict:
    """Sort a platform's export into OUT/<student_id>/; return what happened (see the docstring):
    {imported: [manifest rows], unmatched: [(file, why)], ambiguous: [(file, [student_id])],
    superseded: [(file, student_id, kept file)], missing: [(student_id, label)], manifest}."""
    from labkit.common import find_course_root
    source = os.path.join(find_course_root(course), "solutions", lab)
    notebooks = sorted(n[:-6] for n in os.listdir(source) if n.endswith(".ipynb")) \
        if os.path.isdir(source) else []
    if not notebooks:
        raise ValueError(f"no lab {lab!r}: solutions/{lab}/ has no notebook (the lab's name as "
                         "in solutions/, e.g. lab03_memory_and_zero)")
    if not os.path.exists(export):
        raise FileNotFoundError(f"export {export!r} does not exist: the folder or .zip the "
                                "platform's 'download submissions' gave")
    when_due = parse_deadline(deadline) if deadline else None
    rows, _ = read_roster(roster)
    chosen, result = {}, {"unmatched": [], "ambiguous": [], "superseded": []}
    for rel, data, mtime, origin in _export_files(export):
        if not rel.endswith(".ipynb"):
            result["unmatched"].append((rel, "not a notebook (.ipynb)"))
            continue
        if origin == "link" or data is None:
            result["unmatched"].append((rel, "a symbolic link" if origin == "link" else
                                        f"larger than {MAX_NOTEBOOK_BYTES >> 20} MiB"))
            continue
        path_words = words(rel[:-len(".ipynb")])
        found, matched_by = match_file(path_words, rows)
        if not found:
            result["unmatched"].append((rel, "names no roster student (id, login, e-mail or "
                                        "name); rename it or add the student to the roster"))
            continue
        if len(found) > 1:
            result["ambiguous"].append((rel, [r["student_id"] for r in found]))
            continue
        notebook = notebooks[0] if len(notebooks) == 1 else next(
            (nb for nb in sorted(notebooks, key=len, reverse=True)
             if matches(words(nb), path_words)), None)
        if notebook is None:
            result["unmatched"].append((rel, f"names no notebook of {lab} "
                                        f"({', '.join(notebooks)})"))
            continue
        named = timestamp_in_name(os.path.basename(rel))     # naive: this machine's zone
        stamp, stamp_from = (named.astimezone(), "name") if named else (mtime, origin)
        late = "yes" if "late" in path_words else ""
        if when_due is not None:
            late = "yes" if late or stamp > when_due else "no"
        entry = {"student_id": found[0]["student_id"], "notebook": f"{notebook}.ipynb",
                 "file": rel, "timestamp": stamp.isoformat(timespec="seconds"),
                 "timestamp_from": stamp_from, "late": late, "matched_by": matched_by,
                 "_data": data, "_stamp": stamp}
        key = (entry["student_id"], notebook)
        if key in chosen:
            old, new = sorted([chosen[key], entry], key=lambda e: e["_stamp"])
            result["superseded"].append((old["file"], entry["student_id"], new["file"]))
            entry = new
        chosen[key] = entry
    _write(out, lab, chosen, layout)
    result["imported"] = [{k: v for k, v in e.items() if not k.startswith("_")}
                          for _, e in sorted(chosen.items())]
    have = {s for s, _ in chosen}
    result["missing"] = [(r["student_id"], r["label"]) for r in rows if r["student_id"] not in have]
    result["manifest"] = os.path.join(out, "manifest.csv")
    return result


def _write(out: str, lab: str, chosen: dict, layout: str) -> None:
    os.makedirs(out, exist_ok=True)
    students = sorted({s for s, _ in chosen})
    for student in students:
        folder = os.path.join(out, student)
        shutil.rmtree(folder, ignore_errors=True)           # a re-import replaces the student
        target = os.path.join(folder, lab) if layout == "nbgrader" else folder
        os.makedirs(target)
        entries = [e for (s, _), e in chosen.items() if s == student]
        for e in entries:
            with open(os.path.join(target, e["notebook"]), "wb") as f:
                f.write(e["_data"])
        newest = max(e["_stamp"] for e in entries).astimezone(dt.timezone.utc)
        with open(os.path.join(target, "timestamp.txt"), "w") as f:
            f.write(newest.strftime("%Y-%m-%d %H:%M:%S.%f %Z") + "\n")
    with open(os.path.join(out, "manifest.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, ["student_id", "notebook", "file", "timestamp",
                                    "timestamp_from", "late", "matched_by"],
                                extrasaction="ignore")
        writer.writeheader()
        for _, e in sorted(chosen.items()):
            writer.writerow(e)


def export_feedback(lab: str, out: str, grading: str | None = None, db: str | None = None,
                    manifest: str | None = None, course: str | None = None) -> dict:
    """One zip of feedback per graded student and a grades CSV; return {students, archives,
    no_feedback, grades_csv}."""
    from nbgrader.api import Gradebook, MissingEntry
    from labkit.common import find_course_root
    from labkit.grading.report import find_gradebook
    if grading is None:
        grading = os.path.join(find_course_root(course), "grading", lab)
    db_url = find_gradebook(lab, db=db, grading=grading, course=course, command="export")
    from labkit.grading.pipeline import use_alembic_head_in_process
    use_alembic_head_in_process()
    with Gradebook(db_url) as gb:
        try:
            gb.find_assignment(lab)
        except MissingEntry:
            raise LookupError(f"the gradebook {db_url} has no lab {lab!r}: grade it first "
                              f"(labkit grade {lab} SUBMISSIONS)") from None
        scores = {s.student.id: (float(s.score), float(s.max_score))
                  for s in gb.assignment_submissions(lab)}
    late = {}
    if manifest:
        with open(manifest, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("late") == "yes" or row["student_id"] not in late:
                    late[row["student_id"]] = row.get("late", "")
    os.makedirs(out, exist_ok=True)
    os.chmod(out, 0o700)
    archives, no_feedback = [], []
    for student in sorted(scores):
        folder = os.path.join(grading, "feedback", student, lab)
        pages = sorted(n for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                       if n.endswith(".html") and not os.path.islink(os.path.join(folder, n)))
        if not pages:
            no_feedback.append(student)
            continue
        archive = os.path.join(out, f"{student}.zip")
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
            for name in pages:
                z.write(os.path.join(folder, name), f"{lab}/{name}")
        archives.append(archive)
    grades_csv = os.path.join(out, "grades.csv")
    with open(grades_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student_id", "score", "max_score", "late"])
        for student, (score, max_score) in sorted(scores.items()):
            writer.writerow([student, f"{score:g}", f"{max_score:g}", late.get(student, "")])
    return {"students": sorted(scores), "archives": archives, "no_feedback": no_feedback,
            "grades_csv": grades_csv, "late_known": bool(manifest)}


# --- the two subcommands ----------------------------------------------------------------
class ImportCommand:
    """`labkit import LAB EXPORT --roster ROSTER.csv --out SUBMISSIONS_DIR [--deadline ISO]`."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("lab", help="lab name, as in solutions/<LAB>/")
        parser.add_argument("export", help="the platform's download of all submissions: a "
                            "folder or a .zip (Canvas, Moodle, Blackboard file names)")
        parser.add_argument("--roster", required=True, help="CSV with a student id column and "
                            "any of login, e-mail, name (or first/last name), platform user id")
        parser.add_argument("--out", required=True, help="SUBMISSIONS_DIR for `labkit grade`")
        parser.add_argument("--deadline", default=None, help="ISO date and time (e.g. "
                            "2025-03-07T23:59, this machine's zone; or +01:00): a late column")
        parser.add_argument("--layout", choices=["flat", "nbgrader"], default="flat",
                            help="OUT/<id>/<nb>.ipynb (flat) or nbgrader's OUT/<id>/<LAB>/")
        parser.add_argument("--course", default=None, help="course repository (default: here)")

    @staticmethod
    def run(args) -> int:
        try:
            r = import_submissions(args.lab, args.export, args.roster, args.out, args.deadline,
                                   args.course, args.layout)
        except (ValueError, FileNotFoundError, OSError) as error:
            print(f"labkit import: {error}", file=sys.stderr)
            return 2
        students = {e["student_id"] for e in r["imported"]}
        late = sum(1 for e in r["imported"] if e["late"] == "yes")
        print(f"labkit import {args.lab}: {len(r['imported'])} notebooks of {len(students)} "
              f"students -> {os.path.abspath(args.out)}; {late} late; manifest {r['manifest']}")
        for title, items, show in [
                ("not matched", r["unmatched"], lambda u: f"{u[0]}: {u[1]}"),
                ("matched twice (not imported; rename the file to hold the student id)",
                 r["ambiguous"], lambda a: f"{a[0]}: {', '.join(a[1])}"),
                ("superseded (a newer file of the same student)", r["superseded"],
                 lambda s: f"{s[0]}: {s[1]} keeps {s[2]}"),
                ("roster students without a file", r["missing"],
                 lambda m: f"{m[0]} ({m[1]})")]:
            if items:
                print(f"{title} ({len(items)}):")
                for item in items:
                    print(f"  {show(item)}")
        return 1 if r["unmatched"] or r["ambiguous"] else 0


class ExportCommand:
    """`labkit export LAB --out DIR [--grading DIR] [--db URL] [--manifest CSV]`."""

    @staticmethod
    def add_arguments(parser) -> None:
        parser.add_argument("lab", help="lab name, as graded")
        parser.add_argument("--out", required=True, help="folder for <student>.zip and grades.csv")
        parser.add_argument("--grading", default=None, help="the --out of `labkit grade` "
                            "(default: grading/<LAB>/)")
        parser.add_argument("--db", default=None, help="gradebook URL (default: the sqlite "
                            "gradebook in --grading)")
        parser.add_argument("--manifest", default=None, help="manifest.csv of `labkit import`: "
                            "fills the late column")
        parser.add_argument("--course", default=None, help="course repository (default: here)")

    @staticmethod
    def run(args) -> int:
        try:
            r = export_feedback(args.lab, args.out, args.grading, args.db, args.manifest,
                                args.course)
        except (LookupError, FileNotFoundError, OSError) as error:
            print(f"labkit export: {error}", file=sys.stderr)
            return 2
        print(f"labkit export {args.lab}: {len(r['archives'])} feedback archives, grades of "
              f"{len(r['students'])} students -> {r['grades_csv']}"
              + ("" if r["late_known"] else " (late column empty: pass --manifest "
                 "SUBMISSIONS_DIR/manifest.csv)"))
        if r["no_feedback"]:
            print(f"no feedback file ({len(r['no_feedback'])}; withheld or not generated: see "
                  f"the grading summary): {', '.join(r['no_feedback'])}")
        return 0
