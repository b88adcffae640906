"""The student's JupyterLab after `labkit student-setup` (issue 30): nbgrader's instructor panels
are gone from the page a student sees.

Two Lab pages side by side, on the same course files and the same installed nbgrader: the suite's
own Lab (instructor plugins active: the positive control, so a label that never shows cannot
pass for an absent one) and a Lab whose user config `labkit student-setup --user` wrote (the same
plugin list the student copy's `labkit student-setup` disables and locks in its environment).
What is compared is what Lab rendered: the main menu's labels and the side bars' tab titles.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from lab_server import REPO, LabServer

pytestmark = [pytest.mark.browser]
SCREENSHOTS = REPO / "build" / "screenshots"

# what nbgrader's instructor plugins put on the page before anything is opened: the Nbgrader menu
# (its Formgrader, course and assignment list entries live in it) and the Create Assignment side
# panel (its tab's label and title); Formgrader's own title shows only once it is opened
INSTRUCTOR_LABELS = {"Nbgrader", "Create Assignment", "Nbgrader Create Assignment"}

SEEN = """() => {
  const texts = new Set();
  for (const e of document.querySelectorAll('.lm-MenuBar-itemLabel, .lm-TabBar-tabLabel'))
    texts.add(e.textContent.trim());
  for (const e of document.querySelectorAll('.jp-SideBar .lm-TabBar-tab'))
    if (e.title) texts.add(e.title.split('\\n')[0].trim());
  return [...texts];
}"""


def _labels(browser, server, name: str) -> set:
    page = browser.new_page()
    try:
        page.goto(server.url("lab"))
        page.locator(".lm-MenuBar-itemLabel", has_text="File").first.wait_for(timeout=60_000)
        page.wait_for_timeout(1500)               # plugins add their menus after File's
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"student-copy-{name}.png"))
        return set(page.evaluate(SEEN))
    finally:
        page.close()


def _student_setup(env):
    done = subprocess.run([sys.executable, "-m", "labkit.tools.cli", "student-setup", "--user"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "instructor panels are off" in done.stdout, done.stdout


def test_student_setup_removes_the_instructor_panels_from_the_page(lab, browser, lab_root,
                                                                  tmp_path_factory):
    control = _labels(browser, lab, "instructor")
    assert INSTRUCTOR_LABELS <= control, (
        f"the suite's Lab shows no {sorted(INSTRUCTOR_LABELS - control)}: nbgrader's plugins "
        f"changed their labels, so this test could not see them go (seen: {sorted(control)})")
    student = LabServer(lab_root, tmp_path_factory.mktemp("student_lab_state"),
                        configure=_student_setup)
    try:
        student.start()
        seen = _labels(browser, student, "student")
    finally:
        student.stop()
    assert not INSTRUCTOR_LABELS & seen, (
        f"after labkit student-setup the student's Lab still shows "
        f"{sorted(INSTRUCTOR_LABELS & seen)}")
    assert "File" in seen and "Kernel" in seen, sorted(seen)
