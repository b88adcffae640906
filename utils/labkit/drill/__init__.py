"""The interview drill: the course's derivations with fresh numbers every time, and seed 004's
questions as cards, with spaced repetition (`course/drill.ipynb`; `labkit drill`).

    from labkit import drill
    drill.widget(topic="moe", n=5)              # in a notebook: ask, answer, check, explain, score
    p = drill.problem("ring-bytes", seed=7)     # one numeric drill: p.question, p.answer, p.solution
    drill.check(p, "1.75 GB")                   # Verdict("right" | "wrong" | "invalid", message)
    session = drill.Session(topic="memory", seed=3, n=4, path="/tmp/d.json")
    labkit drill --topic moe -n 10 --seed 7     # in a terminal (`terminal.py`)

| module | what |
|---|---|
| `base` | a Problem and its answer, parsing what people type (units, fractions, lists), verdicts, chapter links |
| `numeric`, `numeric_comm`, `numeric_scale`, `numeric_mesh`, `numeric_recovery`, `numeric_context` | the numeric drills, each drawing its parameters from a seed and computing its answer with the chapter's own function (chapters 1, 3-10; `numeric_mesh`: chapter 6's decisions, memory per rank, axis and link, tp/pp/dp among four) |
| `cards`, `cards_text` | seed 004's whiteboard, self-check and open questions with model answers; figures computed from the chapters |
| `boxes` | the Leitner boxes in a JSON file (default `~/.labkit/drill.json`, or `$LABKIT_DRILL_FILE`) |
| `session` | the order of questions, answers and commands, the record, the summary with the weakest topics |
| `terminal` | `labkit drill`: `add_arguments(parser)` and `run(args)` |
| `notebook` | the ipywidgets front end (`drill.widget()`) |

Nothing here is a graded answer: every number comes from a function a chapter already teaches
and measures. A drill whose function is missing from labkit (an older copy of the course) names the
function it waits for (`drill.catalogue()`) and is skipped.
"""
import re
import textwrap

from labkit.drill.base import (AnswerError, DrillError, MissingFormula, Problem,  # noqa: F401
                               Verdict, chapter_link, check, parse_number, parse_ranks)
from labkit.drill.boxes import Store  # noqa: F401
from labkit.drill.cards import CARDS, Card  # noqa: F401
from labkit.drill.numeric import DRILLS, NumericDrill, formula  # noqa: F401
from labkit.drill.session import TOPICS, Feedback, Question, Session, resolve_topic  # noqa: F401


def problem(drill_id: str, seed=0, params: dict | None = None) -> Problem:
    """One numeric drill drawn from `seed` (or at `params`)."""
    if drill_id not in DRILLS:
        raise DrillError(f"no numeric drill {drill_id!r}; the drills are: {', '.join(DRILLS)}")
    return DRILLS[drill_id].problem(seed=seed, params=params)


def catalogue() -> list:
    """One row per drill and card: id, kind, topic, chapter, title, uses, ready, missing."""
    rows = []
    for topic in TOPICS:
        for key, d in DRILLS.items():
            if d.topic == topic:
                missing = [m.name for m in d.missing()]
                rows.append({"id": key, "kind": "numeric drill", "topic": topic,
                             "chapter": d.chapter, "title": d.title, "uses": list(d.uses),
                             "ready": not missing, "missing": missing})
        for key, c in CARDS.items():
            if c.topic == topic:
                rows.append({"id": key, "kind": f"card ({c.source})", "topic": topic,
                             "chapter": c.links[0][0],
                             "title": textwrap.shorten(re.split(r"[:?]", c.prompt)[0], 64,
                                                       placeholder=" ..."),
                             "uses": [], "ready": True, "missing": []})
    return rows


def widget(topic=None, seed=None, n: int = 5, path=None, kinds: str = "all"):
    """The notebook front end (see `labkit.drill.notebook.DrillWidget`)."""
    from labkit.drill.notebook import DrillWidget
    return DrillWidget(topic=topic, seed=seed, n=n, path=path, kinds=kinds)


def add_arguments(parser):
    """`labkit drill`'s arguments (the CLI table may name `labkit.drill` or its `terminal`)."""
    from labkit.drill.terminal import add_arguments as add
    add(parser)


def run(args) -> int:
    from labkit.drill.terminal import run as run_terminal
    return run_terminal(args)
