"""The term's loop at class scale (issue 30): a learning platform's export in (`labkit import`:
renamed files matched to a roster, late work), grades and feedback out (`labkit export`), and
`labkit report` finding the gradebook of a `labkit grade --out DIR` run. Every command runs as a
subprocess, as an instructor types it; the end-to-end test grades two real submissions."""
import csv
import datetime as dt
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from grading_helpers import LAB, MAX_SCORE, make_submission, needs_root_sandbox

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]
DEADLINE = "2025-03-07T23:59"
ROSTER = """Student,ID,SIS User ID,SIS Login ID,Email
"Smith, Jane",12345,s001,jsmith,jane.smith@uni.example
"Doe, John",22222,s002,jdoe,john.doe@uni.example
"Smith, Jane",33333,s003,jsmith2,jane.smith2@uni.example
"Lee, Ann",44444,s004,alee,ann.lee@uni.example
"Müller, José",55555,s005,jmuller,jose.muller@uni.example
"Kim, Bo",66666,s006,bkim,bo.kim@uni.example
"""


def _labkit(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "labkit.tools.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=540, cwd=cwd)


def _local(text):
    return dt.datetime.fromisoformat(text).astimezone().timestamp()


def _export(course, folder, files):
    """The platform's flat export: {file name: (answers, mtime)} from the fixture lab."""
    scratch = folder.parent / "scratch"
    for i, (name, (answers, mtime)) in enumerate(files.items()):
        make_submission(str(course), str(scratch), f"n{i}", answers)
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(scratch / f"n{i}" / f"{LAB}.ipynb", target)
        os.utime(target, (_local(mtime), _local(mtime)))
    shutil.rmtree(scratch)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_import_matches_every_platform_name_and_reports_the_rest(course, tmp_path):
    """Canvas (sortable name, user id, _LATE_), Moodle (full name, a folder per student, accents),
    Blackboard (login, a timestamp in the name) land in <student_id>/labfx.ipynb; two same-named
    students are told apart by the platform id; a name alone that fits both, an unknown name and
    a non-notebook are reported and not imported; the older of two files is superseded; a roster
    student without a file is named; late is judged from the name's timestamp, else the mtime."""
    export = tmp_path / "export"
    _export(course, export, {
        "smithjane_12345_67890_labfx.ipynb": ({}, "2025-03-07T12:00"),
        "smithjane_LATE_33333_67891_labfx.ipynb": ({}, "2025-03-07T12:00"),
        "John Doe_123_assignsubmission_file_labfx.ipynb": ({}, "2025-03-08T01:00"),
        "John Doe_123_assignsubmission_file_labfx (1).ipynb": ({}, "2025-03-07T20:00"),
        "José Müller_124_assignsubmission_file_/labfx.ipynb": ({}, "2025-03-01T09:00"),
        "labfx_bkim_attempt_2025-03-06-09-30-00_labfx.ipynb": ({}, "2025-03-09T09:00"),
        "smithjane_labfx.ipynb": ({}, "2025-03-07T12:00"),
        "unknown_99999_labfx.ipynb": ({}, "2025-03-07T12:00"),
    })
    (export / "readme.txt").write_text("not a notebook")
    roster = tmp_path / "roster.csv"
    roster.write_text(ROSTER, encoding="utf-8")
    subs = tmp_path / "subs"
    done = _labkit("import", LAB, export, "--roster", roster, "--out", subs, "--deadline",
                   DEADLINE, "--course", course)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text                    # files it could not place: not 0
    assert "Traceback" not in text
    assert "5 notebooks of 5 students" in text and "2 late" in text, text
    assert "not matched (2):" in text and "unknown_99999_labfx.ipynb" in text, text
    assert "readme.txt: not a notebook" in text, text
    assert "matched twice" in text and "smithjane_labfx.ipynb: s001, s003" in text, text
    assert "labfx (1).ipynb: s002 keeps John Doe_123_assignsubmission_file_labfx.ipynb" in text
    assert "roster students without a file (1):" in text and "s004 (ann lee)" in text, text

    manifest = {r["student_id"]: r for r in _rows(subs / "manifest.csv")}
    assert sorted(manifest) == ["s001", "s002", "s003", "s005", "s006"]
    assert {s: r["late"] for s, r in manifest.items()} == {
        "s001": "no", "s002": "yes", "s003": "yes", "s005": "no", "s006": "no"}
    assert manifest["s001"]["matched_by"] == "name+other id"
    assert manifest["s006"]["matched_by"] == "login"
    assert manifest["s006"]["timestamp_from"] == "name"
    assert manifest["s006"]["timestamp"].startswith("2025-03-06T09:30:00")
    assert manifest["s002"]["timestamp_from"] == "mtime"
    for student in manifest:
        assert sorted(os.listdir(subs / student)) == [f"{LAB}.ipynb", "timestamp.txt"]
    stamp = (subs / "s006" / "timestamp.txt").read_text().strip()
    assert stamp.endswith(" UTC")
    assert dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f %Z").replace(
        tzinfo=dt.timezone.utc).timestamp() == _local("2025-03-06T09:30")

    # the platform's .zip as downloaded: the same placement, times from the zip's entries
    archive = shutil.make_archive(str(tmp_path / "export"), "zip", export)
    done = _labkit("import", LAB, archive, "--roster", roster, "--out", tmp_path / "fromzip",
                   "--deadline", DEADLINE, "--course", course)
    zipped = {r["student_id"]: r for r in _rows(tmp_path / "fromzip" / "manifest.csv")}
    assert done.returncode == 1 and sorted(zipped) == sorted(manifest), done.stdout
    assert {s: r["late"] for s, r in zipped.items()} == {s: r["late"]
                                                         for s, r in manifest.items()}
    assert zipped["s002"]["timestamp_from"] == "zip"
    assert (tmp_path / "fromzip" / "s005" / f"{LAB}.ipynb").read_bytes() == \
        (subs / "s005" / f"{LAB}.ipynb").read_bytes()

    # nbgrader's own layout, and errors that say what to do instead of a traceback
    done = _labkit("import", LAB, export, "--roster", roster, "--out", tmp_path / "nbg",
                   "--layout", "nbgrader", "--course", course)
    assert (tmp_path / "nbg" / "s001" / LAB / f"{LAB}.ipynb").exists(), done.stdout
    assert {r["late"] for r in _rows(tmp_path / "nbg" / "manifest.csv")} == {"", "yes"}
    bad = tmp_path / "bad.csv"
    bad.write_text("Name,Email\nJane Smith,j@x\n")
    done = _labkit("import", LAB, export, "--roster", bad, "--out", tmp_path / "x",
                   "--course", course)
    assert done.returncode == 2 and "no student id column" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = _labkit("import", LAB, export, "--roster", roster, "--out", tmp_path / "x",
                   "--deadline", "friday", "--course", course)
    assert done.returncode == 2 and "expected an ISO date" in done.stderr, done.stderr


def test_report_without_a_gradebook_says_what_to_pass(tmp_path):
    """No gradebook anywhere near: one line naming --grading DIR and --db URL, exit 2."""
    (tmp_path / "course" / "solutions").mkdir(parents=True)
    done = _labkit("report", LAB, "--course", tmp_path / "course", cwd=tmp_path / "course")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "--grading DIR" in done.stderr and "--db URL" in done.stderr, done.stderr
    done = _labkit("report", LAB, "--grading", tmp_path / "nowhere", cwd=tmp_path)
    assert done.returncode == 2 and "no gradebook at" in done.stderr, done.stderr


@needs_root_sandbox()
@pytest.mark.timeout(600)
def test_import_grade_report_export_end_to_end(course, tmp_path):
    """Two platform files in, graded into `--out DIR`; `labkit report LAB` finds that gradebook
    with no option; `labkit export` gives each student a zip of their feedback HTML and the
    platform a CSV of id, score, max and late."""
    export = tmp_path / "export"
    _export(course, export, {
        "smithjane_12345_67890_labfx.ipynb": ({}, "2025-03-07T12:00"),
        "John Doe_123_assignsubmission_file_labfx.ipynb": (
            {"task_add": "def add(a, b):\n    return a * b"}, "2025-03-08T01:00"),
    })
    roster = tmp_path / "roster.csv"
    roster.write_text(ROSTER, encoding="utf-8")
    subs = tmp_path / "subs"
    done = _labkit("import", LAB, export, "--roster", roster, "--out", subs, "--deadline",
                   DEADLINE, "--course", course)
    assert done.returncode == 0, done.stdout + done.stderr
    graded = course / "graded-elsewhere"
    done = _labkit("grade", LAB, subs, "--course", course, "--out", graded, "--jobs", "2",
                   "--cell-timeout", "20")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    done = _labkit("report", LAB, cwd=course)           # grading/labfx/ has none: it searches
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"gradebook {graded / 'gradebook.db'}" in done.stdout
    assert (graded / "report.html").exists()

    returned = tmp_path / "returned"
    done = _labkit("export", LAB, "--out", returned, "--grading", graded, "--manifest",
                   subs / "manifest.csv", "--course", course)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 feedback archives, grades of 2 students" in done.stdout, done.stdout
    grades = {r["student_id"]: r for r in _rows(returned / "grades.csv")}
    assert grades == {
        "s001": {"student_id": "s001", "score": f"{MAX_SCORE:g}", "max_score": f"{MAX_SCORE:g}",
                 "late": "no"},
        "s002": {"student_id": "s002", "score": f"{MAX_SCORE - 1:g}",
                 "max_score": f"{MAX_SCORE:g}", "late": "yes"}}
    for student in grades:
        with zipfile.ZipFile(returned / f"{student}.zip") as z:
            assert z.namelist() == [f"{LAB}/{LAB}.html"]
            page = z.read(f"{LAB}/{LAB}.html").decode()
        assert page == (graded / "feedback" / student / LAB / f"{LAB}.html").read_text()
    assert os.stat(returned).st_mode & 0o077 == 0
