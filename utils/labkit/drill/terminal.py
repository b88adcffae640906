"""`labkit drill`: the interview drill in a terminal, plain prompts that work over SSH.

    labkit drill                              # 5 questions from every topic, due ones first
    labkit drill --topic moe -n 10 --seed 7   # one topic, ten questions, reproducible numbers
    labkit drill --kind cards                 # only the cards (or --kind numbers)
    labkit drill --list                       # every drill and card, and the functions they use
    labkit drill --file /tmp/d.json           # keep the boxes elsewhere (or $LABKIT_DRILL_FILE)
    python -m labkit.drill.terminal ...       # the same

During a question: type the answer, or 'skip', 'hint', 'topic NAME', 'help', 'quit'. Ctrl-D
ends the session too; the summary (weakest topics, boxes) is printed either way.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import textwrap

from labkit.drill.base import DrillError, taught_in
from labkit.drill.session import KINDS, TOPICS, Session, topic_label


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", default=None,
                        help=f"one topic: {', '.join(TOPICS)} (default: every topic)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the drawn numbers (default: a new one, printed)")
    parser.add_argument("-n", type=int, default=5, help="questions in this session (5)")
    parser.add_argument("--kind", default="all", choices=KINDS,
                        help="numeric drills, cards or both (all)")
    parser.add_argument("--file", default=None,
                        help="the Leitner boxes' file (default ~/.labkit/drill.json, or "
                             "$LABKIT_DRILL_FILE)")
    parser.add_argument("--list", action="store_true", help="list the drills and cards, then exit")


class Screen:
    """Printing for a terminal: wrapped to its width, flushed at once (pipes and ptys alike)."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.width = max(40, min(shutil.get_terminal_size((80, 24)).columns, 100) - 2)

    def say(self, text: str = "", indent: str = "") -> None:
        for paragraph in str(text).splitlines() or [""]:
            lead = indent + paragraph[:len(paragraph) - len(paragraph.lstrip())]
            wrapped = textwrap.fill(paragraph.strip(), self.width, initial_indent=lead,
                                    subsequent_indent=lead + "  ", break_on_hyphens=False,
                                    break_long_words=False) if paragraph.strip() else ""
            print(wrapped, file=self.out)
        self.out.flush()


def ask(prompt: str, screen: Screen):
    """One line typed by the person; None at end of input (Ctrl-D) or Ctrl-C."""
    try:
        screen.out.flush()
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        print(file=screen.out)
        return None


def show_question(question, screen: Screen) -> None:
    screen.say()
    screen.say(f"[{question.index}/{question.total}] {question.topic}: {question.title} "
               f"(box {question.box})")
    screen.say(question.text, "  ")
    if question.problem is not None:
        screen.say(question.problem.how_to_answer(), "  ")
    else:
        screen.say("Write your answer on one line, or 'skip' to see the model answer.", "  ")


def show_feedback(feedback, screen: Screen) -> None:
    screen.say(feedback.message, "  ")
    for line in feedback.solution:
        screen.say(line, "  ")
    if feedback.links:
        screen.say(taught_in(feedback.links), "  ")


def drive(session: Session, screen: Screen) -> None:
    """Ask until the session is over or the person quits."""
    while (question := session.next()) is not None:
        show_question(question, screen)
        while question.state != "done":
            prompt = "Did you have it? [y/n] > " if question.state == "revealed" else "> "
            line = ask(prompt, screen)
            if line is None:
                return
            feedback = session.answer(line)
            show_feedback(feedback, screen)
            if feedback.status == "quit":
                return
            if session.current is not question:      # the topic changed: a new question
                break


def catalogue_text(width: int = 78) -> str:
    """One entry per drill and card, grouped by topic: id, chapter and kind in fixed columns, the
    title wrapped under its own column (never cut, never spilling under the id), and below a drill
    that cannot run yet what it waits for. Every line fits in `width` (78 in a terminal of 80)."""
    from labkit.drill import catalogue
    rows = catalogue()
    key_width = min(max(len(r["id"]) for r in rows), 22)
    lines, topic = [], None
    for row in rows:
        if row["topic"] != topic:
            topic = row["topic"]
            lines.append(("" if not lines else "\n") + f"{topic}:")
        kind = "drill" if row["kind"] == "numeric drill" else "card"
        lead = f"  {row['id']:<{key_width}}  ch.{row['chapter']:<2}  {kind:<5}  "
        if len(lead) > width // 2:                    # an id too long for its column: own line
            lines.append(f"  {row['id']}")
            lead = f"  {'':<{key_width}}  ch.{row['chapter']:<2}  {kind:<5}  "
        hang = " " * len(lead)
        lines += textwrap.wrap(row["title"], width, initial_indent=lead, subsequent_indent=hang,
                               break_on_hyphens=False) or [lead.rstrip()]
        if not row["ready"]:
            lines += textwrap.wrap("waits for " + ", ".join(row["missing"]), width,
                                   initial_indent=hang, subsequent_indent=hang + "  ")
    lines.append("")
    lines += textwrap.wrap("Numeric drills draw fresh numbers each time; cards are seed 004's "
                           "questions.", width)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    screen = Screen()
    if args.list:
        print(catalogue_text(screen.width), file=screen.out)
        return 0
    if args.n < 1:
        screen.say(f"labkit drill: -n must be at least 1, got {args.n}")
        return 2
    try:
        session = Session(topic=args.topic, seed=args.seed, n=args.n, path=args.file,
                          kinds=args.kind)
    except DrillError as exc:
        screen.say(f"{str(exc)[0].upper()}{str(exc)[1:]}")
        screen.say("Drilling every topic instead; type 'topic NAME' to switch.")
        session = Session(topic=None, seed=args.seed, n=args.n, path=args.file, kinds=args.kind)
    screen.say(f"labkit drill: {session.n} questions, {topic_label(session.topic)}, seed "
               f"{session.seed} (--seed {session.seed} draws the same numbers again).")
    screen.say(f"Boxes kept in {session.store.path} (session {session.store.session}). "
               "Type 'help' for the commands.")
    for note in session.store.notes:
        screen.say(note)
    drive(session, screen)
    screen.say()
    screen.say(session.summary_text())
    return 0


def main(argv=None) -> int:
    from labkit.common import run_module
    return run_module(sys.modules[__name__], argv, prog="labkit drill",
                      description="the interview drill: derivations and cards, in a terminal")


if __name__ == "__main__":
    sys.exit(main())
