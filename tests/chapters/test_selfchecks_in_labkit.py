"""Chapters 3, 8, 9 and 10: check-yourself questions keep their answers in labkit (issues 28, 29): the cells
ask, `labkit.faults.selfcheck` judges the answer against what the chapter measured."""
import json
from pathlib import Path

from labkit.faults import selfcheck

ROOT = Path(__file__).resolve().parents[2]


def _code_cells():
    book = json.loads((ROOT / "course" / "09_failures_at_scale.ipynb").read_text())
    return ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]


def test_the_chapter_asks_and_labkit_answers():
    cells = _code_cells()
    asking = [c for c in cells if "answer_wait = None" in c or "answer_resume, answer_redone" in c]
    assert len(asking) == 2, "the two questions of sections 3 and 4"
    assert "selfcheck.straggler_wait(" in asking[0] and "selfcheck.elastic_resume(" in asking[1]
    for cell in asking:       # the reasoning is not in the cell below the question
        assert "whatever its own work takes" not in cell and "newest" not in cell, cell


def test_straggler_wait_judges_against_the_measurement(capsys):
    assert selfcheck.straggler_wait(None, measured=0.1, delay=0.1) is False
    assert "first" in capsys.readouterr().out
    assert selfcheck.straggler_wait(0.11, measured=0.1, delay=0.1) is True
    assert selfcheck.straggler_wait(0.005, measured=0.1, delay=0.1) is False
    assert "last rank has entered" in capsys.readouterr().out


def test_elastic_resume_needs_both_answers_right(capsys):
    summary = {"resumed_from": 4, "redone": [5, 6]}
    assert selfcheck.elastic_resume(None, None, summary) is False
    assert selfcheck.elastic_resume(4, 2, summary) is True
    assert selfcheck.elastic_resume(4, None, summary) is False
    assert selfcheck.elastic_resume(6, 2, summary) is False
    out = capsys.readouterr().out
    assert "resume step: 4, you said 6" in out and "steps done twice: right" in out


def test_chapter_3_asks_and_labkit_answers(capsys):
    """Chapter 3's four questions: the cell under each asks labkit, which holds the answer."""
    from labkit.memory import selfcheck as memory_check
    book = json.loads((ROOT / "course" / "03_memory_and_zero.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    for q in ("q1", "q2", "q3", "q4"):
        assert f'selfcheck.ask("{q}", {q})' in cells, q
    assert not any("labkit.memory.ask(" in c for c in cells), "an answer in visible source"
    assert memory_check.ask("q2", None) is None
    assert memory_check.ask("q2", 37.4) is True and memory_check.ask("q3", 32) is False
    assert "2 x 16 x 10 = 320" in capsys.readouterr().out


def test_chapter_10_asks_and_labkit_answers(capsys):
    from labkit.context import selfcheck as context_check
    book = json.loads((ROOT / "course" / "10_long_sequences.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    asks = next(i for i, c in enumerate(cells) if "selfcheck.check([answer_1" in c)
    after = cells[asks - 1:]                  # the answers' cell and what follows the question
    assert not any("r + 1 blocks" in c or "17/4" in c for c in after), "an answer in visible source"
    assert context_check.check([None] * 5) == [None] * 5
    assert "17/4" not in capsys.readouterr().out
    assert context_check.check([6, 4.25, None, None, True]) == [True, True, None, None, False]


def test_chapter_8_dcp_quiz_asks_and_labkit_answers(capsys):
    """Chapter 8's DCP quiz: the cell saves and reads `.metadata`; labkit judges and shows the walk."""
    from labkit.checkpoint import selfcheck as checkpoint_check
    book = json.loads((ROOT / "course" / "08_checkpoints.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    quiz = next(c for c in cells if "QUIZ = [" in c)
    assert "selfcheck.dcp_writers(answer, seen, plans[0])" in quiz
    assert "not quite" not in quiz and "truth" not in quiz, "the judging is in visible source"
    plan = [("a", 40), (("w", (0,)), 128), ("b", 40), ("c", 120), ("d", 4)]
    seen = {("a", (0,)): 0, ("w", (0,)): 0, ("w", (16,)): 1, ("b", (0,)): 1, ("c", (0,)): 1,
            ("d", (0,)): 1}
    assert checkpoint_check.dcp_writers("", seen, plan) is False
    assert "walk" not in capsys.readouterr().out, "the walk is shown only after an attempt"
    assert checkpoint_check.dcp_writers("0111", seen, plan) is True
    assert checkpoint_check.dcp_writers("0101", seen, plan) is False
    out = capsys.readouterr().out
    assert "right" in out and ".metadata says 0111, you said 0101" in out
    assert "a -> 0 [40, 0]; w[0:] -> 0 [168, 0]; b -> 1 [168, 40]" in out


def test_chapter_5_asks_and_labkit_answers(capsys):
    """Chapter 5's five questions: the cell after `answers` asks labkit, which holds the truth."""
    from labkit.pipeline import selfcheck as pipeline_check
    book = json.loads((ROOT / "course" / "05_pipeline_parallel.ipynb").read_text())
    cells = ["".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code"]
    assert "from labkit.pipeline import selfcheck" in "\n".join(cells)
    asks = next(i for i, c in enumerate(cells) if "selfcheck.check(answers)" in c)
    assert '"q5": None' in cells[asks - 1], "the answers' cell comes just before"
    for cell in cells[asks - 1:]:             # the answers' cell and what follows the question
        assert "truth" not in cell and "not quite" not in cell and "3 * 5" not in cell, cell
        assert "peak_alive" not in cell and "bubble_formula(8, 24)" not in cell, cell
    unanswered = {f"q{n}": None for n in range(1, 6)}
    assert pipeline_check.check(unanswered) == unanswered
    out = capsys.readouterr().out
    assert out.count("not answered yet") == 5
    assert "(p-1)" not in out and "min(m, p - k)" not in out, "nothing revealed before an attempt"
    verdicts = pipeline_check.check({"q1": 7 / 31, "q3": [8, 1], "q4": False, "q5": (10, 2)})
    assert verdicts == {"q1": True, "q2": None, "q3": True, "q4": False, "q5": False}
    out = capsys.readouterr().out
    assert "q1: right. GPipe's bubble is (p-1)/(m+p-1)" in out
    assert "q5: you said (10, 2); not quite. 1F1B idles (p-1)(t_F + t_I + t_W)" in out
    assert pipeline_check.check({"q5": (15, 5), "q2": 7 / 96, "q4": True}) == {
        "q1": None, "q2": True, "q3": None, "q4": True, "q5": True}
