"""A drill session: which question comes next, what a typed answer gets, what is recorded, and
the summary. Both front ends (`terminal.py`, `notebook.py`) are thin layers over this class, so the
terminal and the notebook ask, check and explain alike.

    session = Session(topic="moe", seed=7, n=5, path="/tmp/drill.json")
    question = session.next()          # None when the session is over
    feedback = session.answer("1.5 GB")  # or "skip", "hint", "help", "topic NAME", "quit"
    print(session.summary_text())

Numbers drawn for a drill depend only on (seed, drill, how many times it came up this session),
so `--seed S` shows the same numbers for the same drill whatever order the boxes choose.
"""
from __future__ import annotations

import dataclasses
import difflib
import random

from labkit.drill.base import CHAPTERS, DrillError, MissingFormula, Problem, check, taught_in
from labkit.drill.boxes import EVERY, Store
from labkit.drill.cards import CARDS, Card
from labkit.drill.numeric import DRILLS

# topic -> chapter, in course order (the labkit topic packages)
TOPICS = {"collectives": 1, "dp": 2, "memory": 3, "tensor_parallel": 4, "pipeline": 5,
          "mesh": 6, "moe": 7, "checkpoint": 8, "faults": 9, "context": 10}
ALIASES = {"numerics": "dp", "bf16": "dp", "data_parallel": "dp", "zero": "memory",
           "tp": "tensor_parallel", "tensor-parallel": "tensor_parallel", "pp": "pipeline",
           "3d": "mesh", "ep": "moe", "experts": "moe", "checkpoints": "checkpoint",
           "failures": "faults", "hangs": "faults", "cp": "context", "ring-attention": "context",
           "long-context": "context", "ulysses": "context", "all": None, "every": None}
KINDS = ("all", "numbers", "cards")
HELP = ("Type your answer and press Enter. Commands: 'skip' (show the solution; counts as "
        "missed), 'hint' (where the course teaches it), 'topic NAME' (switch topic; 'topic all' "
        "for every topic), 'help', 'quit' (end with a summary).")


def resolve_topic(name):
    """A topic name or alias -> the topic (None: every topic); DrillError listing the topics."""
    if name is None:
        return None
    key = str(name).strip().lower().replace(" ", "_")
    if key in ALIASES:
        key = ALIASES[key]
    if key is None or key in TOPICS:
        return key
    close = difflib.get_close_matches(key, list(TOPICS) + list(ALIASES), n=1)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    raise DrillError(f"unknown topic {name!r}.{guess} The topics are: "
                     + ", ".join(f"{t} (ch. {c})" for t, c in TOPICS.items()) + ".")


def topic_label(topic) -> str:
    return "every topic" if topic is None else f"{topic} (ch. {TOPICS[topic]}, " \
        f"{CHAPTERS[TOPICS[topic]]})"


@dataclasses.dataclass
class Question:
    key: str                      # its Leitner key: a drill id or a card id
    index: int                    # 1-based position in the session
    total: int
    box: int
    problem: Problem | None = None
    card: Card | None = None
    state: str = "asking"         # "asking", "revealed" (a card awaiting y/n), "done"

    @property
    def topic(self) -> str:
        return self.problem.topic if self.problem else self.card.topic

    @property
    def title(self) -> str:
        return self.problem.title if self.problem else self.card.title

    @property
    def text(self) -> str:
        return self.problem.question if self.problem else self.card.prompt

    @property
    def links(self) -> list:
        if self.problem:
            return [(self.problem.chapter, self.problem.section)]
        return list(self.card.links)

    def where_taught(self) -> str:
        return taught_in(self.links)


@dataclasses.dataclass
class Feedback:
    status: str                   # invalid, right, wrong, skipped, revealed, recorded, info, quit
    message: str
    solution: list = dataclasses.field(default_factory=list)   # lines shown after the attempt
    done: bool = False            # the question is finished: go to the next one
    links: list = dataclasses.field(default_factory=list)      # [(chapter, section)] teaching it


class Session:
    def __init__(self, topic=None, seed=None, n: int = 5, path=None, kinds: str = "all",
                 store: Store | None = None):
        if kinds not in KINDS:
            raise DrillError(f"kinds must be one of {KINDS}, got {kinds!r}")
        if not isinstance(n, int) or n < 1:
            raise DrillError(f"n (questions per session) must be a whole number >= 1, got {n!r}")
        self.topic = resolve_topic(topic)
        self.seed = random.SystemRandom().randrange(10_000) if seed is None else seed
        self.n, self.kinds = n, kinds
        self.store = store or Store(path)
        self.rng = random.Random(f"order/{self.seed}")
        self.asked, self.right = 0, 0
        self.by_topic: dict = {}
        self.moved: list = []
        self.unavailable: dict = {}   # drill id -> [names of missing chapter functions]
        self.current: Question | None = None
        self._occurrences: dict = {}
        self._used: set = set()

    # ---- choosing questions ----

    def _candidates(self) -> list:
        keys = []
        if self.kinds in ("all", "numbers"):
            keys += [k for k, d in DRILLS.items() if self.topic in (None, d.topic)]
        if self.kinds in ("all", "cards"):
            keys += [k for k, c in CARDS.items() if self.topic in (None, c.topic)]
        return [k for k in keys if k not in self.unavailable]

    def _order(self, keys) -> list:
        """What is due comes first, and among it what was asked before (a question missed last
        session is due again now, as the boxes promise) before what was never asked; then lower
        boxes, then the longest unseen; ties broken by the seed."""
        store = self.store
        return sorted(keys, key=lambda k: (not store.due(k), not store.item(k),
                                           store.box(k), store.item(k).get("last_session", 0),
                                           self.rng.random()))

    def next(self) -> Question | None:
        """The next question, or None when n have been asked or none is left."""
        if self.current is not None and self.current.state != "done":
            return self.current
        if self.asked >= self.n:
            return None
        fresh = [k for k in self._candidates() if k not in self._used]
        pool = fresh or [k for k in self._candidates() if k in DRILLS]   # numbers may repeat
        for key in self._order(pool):
            question = self._pose(key)
            if question is not None:
                self.current = question
                self._used.add(key)
                return question
        self.current = None
        return None

    def _pose(self, key) -> Question | None:
        box = self.store.box(key)
        if key in CARDS:
            return Question(key, self.asked + 1, self.n, box, card=CARDS[key])
        occurrence = self._occurrences.get(key, 0)
        try:
            problem = DRILLS[key].problem(seed=f"{self.seed}:{occurrence}")
        except MissingFormula:
            self.unavailable[key] = [m.name for m in DRILLS[key].missing()]
            return None
        self._occurrences[key] = occurrence + 1
        return Question(key, self.asked + 1, self.n, box, problem=problem)

    # ---- answering ----

    def answer(self, text) -> Feedback:
        """What the person typed: an answer, y/n for a revealed card, or a command."""
        words = str(text or "").strip().split(maxsplit=1)
        command = words[0].lower() if words else ""
        if command in ("quit", "exit", "q"):
            return Feedback("quit", "Ending the session.")
        if command in ("help", "h"):
            return Feedback("info", HELP)
        if command == "topic":
            return self.set_topic(words[1] if len(words) > 1 else "")
        question = self.current
        if question is None or question.state == "done":
            return Feedback("info", "No question is open: ask for the next one.")
        if command in ("skip", "pass", "?"):
            return self.skip()
        if command == "hint":
            uses = f"The answer uses {', '.join(question.problem.uses)}." \
                if question.problem else "Where the course teaches it:"
            return Feedback("info", uses, links=question.links)
        if question.card is not None:
            return self._card_answer(question, str(text or ""))
        verdict = check(question.problem, text)
        if verdict.status == "invalid":
            return Feedback("invalid", verdict.message)
        return self._finish(question, verdict.status == "right", verdict.message)

    def _card_answer(self, question, text) -> Feedback:
        card = question.card
        if question.state == "revealed":
            reply = text.strip().lower()
            if reply in ("y", "yes"):
                return self.grade(True)
            if reply in ("n", "no"):
                return self.grade(False)
            return Feedback("invalid", "Type y if your answer had the model answer's points, n "
                                       "if it did not.")
        if not text.strip():
            return Feedback("invalid", "Empty answer: write your answer first (a line or two is "
                                       "enough), or type 'skip' to see the model answer.")
        question.state = "revealed"
        marks = card.points_mentioned(text)
        found = sum(1 for _, seen in marks if seen)
        lines = card.answer_text().splitlines() + [
            f"Key points (your answer mentions {found} of {len(marks)}, counted by their terms: "
            "you judge):"] + [f"  [{'x' if seen else ' '}] {point}" for point, seen in marks]
        return Feedback("revealed", "Model answer:", lines, links=question.links)

    def grade(self, had_it: bool) -> Feedback:
        """A revealed card, graded by the person: had it (True) or not."""
        question = self.current
        if question is None or question.card is None or question.state != "revealed":
            return Feedback("info", "There is no revealed card to grade.")
        return self._finish(question, bool(had_it),
                            "Marked as known." if had_it else "Marked to come back soon.")

    def skip(self) -> Feedback:
        """Give up on the open question: its solution is shown and it goes back to box 1."""
        question = self.current
        if question is None or question.state == "done":
            return Feedback("info", "No question is open.")
        if question.card is not None:
            lines = question.card.answer_text().splitlines()
            return self._finish(question, False, "Skipped. Model answer:", lines, "skipped")
        return self._finish(question, False,
                            f"Skipped: the answer is {question.problem.expected()}.",
                            status="skipped")

    def _finish(self, question, right, message, lines=None, status=None) -> Feedback:
        before, after = self.store.record(question.key, question.topic, right)
        question.state = "done"
        self.asked += 1
        self.right += int(right)
        counts = self.by_topic.setdefault(question.topic, [0, 0])
        counts[0] += int(right)
        counts[1] += 1
        self.moved.append((question.key, before, after))
        if lines is None:
            lines = (["Worked solution:"] + [f"  {s}" for s in question.problem.solution]
                     if question.problem else [])
        box_line = f"Box {before} -> {after} (back in {EVERY[after]} session" \
                   f"{'s' if EVERY[after] > 1 else ''})."
        shown = question.card is not None and status is None     # a graded card: links shown
        return Feedback(status or ("right" if right else "wrong"), message, lines + [box_line],
                        done=True, links=[] if shown else question.links)

    def set_topic(self, name) -> Feedback:
        """Switch topic mid-session; an unknown name changes nothing and says what exists."""
        if not str(name or "").strip():
            return Feedback("info", f"Topic: {topic_label(self.topic)}. Type 'topic NAME' with "
                            "one of: " + ", ".join(TOPICS) + ", or 'topic all'.")
        try:
            topic = resolve_topic(name)
        except DrillError as exc:
            return Feedback("invalid", str(exc)[0].upper() + str(exc)[1:])
        self.topic = topic
        if self.current is not None:              # an open question is put back, unanswered
            if self.current.state != "done":
                self._used.discard(self.current.key)
            self.current = None
        return Feedback("info", f"Topic: {topic_label(topic)}.")

    # ---- the summary ----

    def summary(self) -> dict:
        self.store.finish({"asked": self.asked, "right": self.right, "by_topic": self.by_topic})
        return {"seed": self.seed, "session": self.store.session, "asked": self.asked,
                "right": self.right, "by_topic": dict(self.by_topic), "moved": list(self.moved),
                "weakest": self.store.weakest(3), "boxes": self.store.box_counts(),
                "unavailable": dict(self.unavailable), "notes": list(self.store.notes),
                "path": str(self.store.path)}

    def summary_text(self) -> str:
        s = self.summary()
        lines = [f"Session {s['session']} (seed {s['seed']}): {s['right']} of {s['asked']} right."]
        lines += [f"  {topic:<16} {r} of {a}" for topic, (r, a) in s["by_topic"].items()]
        if s["weakest"]:
            lines.append("Weakest topics over all sessions: " + ", ".join(
                f"{t} ({r} of {n} right)" for t, r, n, _ in s["weakest"]) + ".")
        lines.append("Boxes: " + "  ".join(f"{b}: {c}" for b, c in s["boxes"].items())
                     + "   (box 1 comes back every session, box 5 every 16th)")
        if s["unavailable"]:
            lines.append("Waiting for functions not in labkit yet: " + ", ".join(
                f"{k} ({', '.join(v)})" for k, v in s["unavailable"].items()) + ".")
        lines += s["notes"]
        if not any("Could not save" in n for n in s["notes"]):
            lines.append(f"Progress kept in {s['path']}.")
        return "\n".join(lines)
