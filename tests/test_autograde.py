"""Each lab's solution earns full marks from nbgrader's autograder; its student copy earns zero."""
import shutil
from pathlib import Path

import pytest

from labkit.tools import release

ROOT = Path(__file__).resolve().parents[1]
LABS = release.lab_sources(ROOT)

# Answers that pass the visible tests but not the hidden ones: (grade_id of the answer cell,
# its replacement source, the score they should earn). They prove the hidden tests are restored
# and run at grading time.
VISIBLE_ONLY = {
    "lab00_first_collectives": ("task3_global_mean", '''
def global_mean(local_values):
    mean = torch.tensor([local_values.mean().item()], dtype=torch.float64)
    dist.all_reduce(mean)                      # the mean of the per-rank means
    return mean.item() / dist.get_world_size()
''', 4),
}


def autograde(course: Path, lab: str, submissions: dict) -> dict:
    """Autograde {student: notebook path} in a throwaway course; return {student: (score, max)}."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config
    release._ensure_tools_on_path()
    course.mkdir(parents=True, exist_ok=True)
    config = Config()
    config.merge(release._config(ROOT, course / "release", course / "gradebook.db"))
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.submitted_directory = str(course / "submitted")
    config.CourseDirectory.autograded_directory = str(course / "autograded")
    config.CourseDirectory.feedback_directory = str(course / "feedback")
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    result = api.generate_assignment(lab)
    assert result["success"], result.get("error") or result.get("log")
    for student, notebook in submissions.items():
        target = course / "submitted" / student / lab
        target.mkdir(parents=True)
        shutil.copy(notebook, target / notebook.name)
        result = api.autograde(lab, student)
        assert result["success"], result.get("error") or result.get("log")
    with Gradebook(config.CourseDirectory.db_url) as gradebook:
        return {student: (gradebook.find_submission(lab, student).score,
                          gradebook.find_submission(lab, student).max_score)
                for student in submissions}


def with_answer(notebook: Path, grade_id: str, source: str, out: Path) -> Path:
    import nbformat
    nb = nbformat.read(str(notebook), as_version=4)
    cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(cells) == 1, f"no answer cell {grade_id} in {notebook}"
    cells[0].source = source.strip()
    out.mkdir(parents=True)
    nbformat.write(nb, str(out / notebook.name))
    return out / notebook.name


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")
@pytest.mark.parametrize("lab", LABS)
def test_solution_scores_full_marks_and_student_copy_zero(lab, tmp_path):
    solution = next((ROOT / "solutions" / lab).glob("*.ipynb"))
    student_copy = ROOT / "labs" / lab / solution.name
    assert student_copy.exists(), f"labs/{lab}/{solution.name} missing: run `make release`"
    submissions = {"solution": solution, "untouched": student_copy}
    if lab in VISIBLE_ONLY:
        grade_id, source, _ = VISIBLE_ONLY[lab]
        submissions["visible-only"] = with_answer(solution, grade_id, source, tmp_path / "edited")
    scores = autograde(tmp_path / "course", lab, submissions)
    score, max_score = scores["solution"]
    assert max_score > 0, f"{lab} has no graded test cells"
    assert score == max_score, f"{lab}: the solution scored {score} of {max_score}"
    assert scores["untouched"][0] == 0, f"{lab}: the untouched student copy scored {scores['untouched']}"
    if lab in VISIBLE_ONLY:
        expected = VISIBLE_ONLY[lab][2]
        assert scores["visible-only"][0] == expected, \
            f"{lab}: an answer that passes only the visible tests scored {scores['visible-only']}, " \
            f"expected {expected} (are the hidden tests restored at grading?)"
