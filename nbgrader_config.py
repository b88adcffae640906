"""nbgrader configuration for the course (read by nbgrader from the repository root).

The labs' nbgrader source lives in solutions/<lab>/ and the student copies are generated into
labs/<lab>/ by `make release` (labkit release). Everything grading writes (gradebook,
submissions, autograded copies, feedback) goes under grading/, which git ignores.
"""
import os

c = get_config()  # noqa: F821 (provided by traitlets when nbgrader loads this file)

_here = os.path.dirname(os.path.abspath(__file__))
_grading = os.path.join(_here, "grading")

c.CourseDirectory.root = _here
c.CourseDirectory.source_directory = os.path.join(_here, "solutions")
c.CourseDirectory.release_directory = os.path.join(_here, "labs")
c.CourseDirectory.submitted_directory = os.path.join(_grading, "submitted")
c.CourseDirectory.autograded_directory = os.path.join(_grading, "autograded")
c.CourseDirectory.feedback_directory = os.path.join(_grading, "feedback")
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(_grading, "gradebook.db")
# Only notebooks and plain data files travel from solutions/ to labs/.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "*.db", ".hypothesis",
                            ".pytest_cache", "build"]

# A released stub keeps the task-naming `raise NotImplementedError("Lab N, task M: ...")` that the
# source writes after the solution region, so nbgrader's own stub only marks the spot.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE"}

# One spelling of the per-cell timeout (a rank hang is diagnosed by labkit well before this).
c.Execute.timeout = 120

# Hidden tests never reach feedback either.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
