"""The drill in a notebook: ipywidgets to ask, answer, check, explain and score
(`course/drill.ipynb`).

    ui = drill.widget(topic="moe", n=5)      # end a cell with `ui` to show it
    ui.submit("1.5 GB")                      # what typing into the box and pressing Check does
    ui.skip(); ui.grade(True); ui.next()     # the other buttons, for scripts and tests

Every button calls the same `Session` methods as the terminal's prompts, so the two front ends
cannot drift apart. Each method returns the `Feedback` it showed.
"""
from __future__ import annotations

import html

from labkit.drill.base import DrillError, html_text, taught_in
from labkit.drill.session import TOPICS, Feedback, Session, topic_label

COLOURS = {"right": "#1a7f37", "wrong": "#cf222e", "skipped": "#cf222e", "invalid": "#9a6700",
           "revealed": "#0969da", "recorded": "#1a7f37", "info": "#57606a", "quit": "#57606a"}


def question_html(question) -> str:
    head = (f"<b>[{question.index}/{question.total}] {html.escape(question.topic)}: "
            f"{html.escape(question.title)}</b> <small>(box {question.box})</small>")
    how = question.problem.how_to_answer() if question.problem else \
        "Write your answer, then press Check to see the model answer."
    return f"{head}<p>{html_text(question.text)}</p><p><i>{html.escape(how)}</i></p>"


def feedback_html(feedback: Feedback) -> str:
    colour = COLOURS.get(feedback.status, "#57606a")
    lines = "".join(f"<div style='white-space: pre-wrap'>{html_text(line)}</div>"
                    for line in feedback.solution)
    links = f"<p>{taught_in(feedback.links, as_html=True)}</p>" if feedback.links else ""
    return (f"<div style='border-left: 4px solid {colour}; padding-left: 8px'>"
            f"<b style='color: {colour}'>{html_text(feedback.message)}</b>{lines}{links}</div>")


class DrillWidget:
    def __init__(self, topic=None, seed=None, n: int = 5, path=None, kinds: str = "all"):
        import ipywidgets as w
        problem = None
        try:
            self.session = Session(topic=topic, seed=seed, n=n, path=path, kinds=kinds)
        except DrillError as exc:
            problem = Feedback("invalid", f"{exc} Drilling every topic instead.")
            self.session = Session(topic=None, seed=seed, n=n, path=path, kinds=kinds)
        # "all", not None, for every topic: a drop-down whose value is None shows nothing selected
        self.topic = w.Dropdown(options=[("every topic", "all")]
                                + [(topic_label(t), t) for t in TOPICS],
                                value=self.session.topic or "all", description="Topic")
        self.header = w.HTML()
        self.question = w.HTML()
        self.entry = w.Text(placeholder="your answer, e.g. 1.5 GB", layout=w.Layout(width="60%"))
        self.essay = w.Textarea(placeholder="your answer, a few lines",
                                layout=w.Layout(width="90%", height="6em"))
        self.check_button = w.Button(description="Check", button_style="primary")
        self.skip_button = w.Button(description="Show solution")
        self.next_button = w.Button(description="Next question")
        self.yes_button = w.Button(description="I had it", button_style="success")
        self.no_button = w.Button(description="I missed it", button_style="warning")
        self.feedback = w.HTML()
        self.summary = w.HTML()
        self.check_button.on_click(lambda _: self._check())
        self.skip_button.on_click(lambda _: self.skip())
        self.next_button.on_click(lambda _: self.next())
        self.yes_button.on_click(lambda _: self.grade(True))
        self.no_button.on_click(lambda _: self.grade(False))
        self._syncing = False
        self.topic.observe(self._topic_changed, names="value")
        self.buttons = w.HBox([self.check_button, self.skip_button, self.next_button])
        self.grades = w.HBox([self.yes_button, self.no_button])
        self.view = w.VBox([self.topic, self.header, self.question, self.entry, self.essay,
                            self.buttons, self.grades, self.feedback, self.summary])
        self.last: Feedback | None = problem
        self._header()
        self.next()
        if problem is not None:
            self.feedback.value = feedback_html(problem)

    def _repr_mimebundle_(self, **kwargs):
        return self.view._repr_mimebundle_(**kwargs)

    # ---- what the buttons do ----

    def submit(self, text) -> Feedback:
        """Type `text` into the answer box and press Check."""
        question = self.session.current
        box = self.essay if question is not None and question.card is not None else self.entry
        box.value = "" if text is None else str(text)
        return self._check()

    def _check(self) -> Feedback:
        question = self.session.current
        text = self.essay.value if question is not None and question.card is not None \
            else self.entry.value
        return self._show_feedback(self.session.answer(text))

    def grade(self, had_it: bool) -> Feedback:
        return self._show_feedback(self.session.grade(had_it))

    def skip(self) -> Feedback:
        return self._show_feedback(self.session.skip())

    def set_topic(self, name) -> Feedback:
        """Switch topic (what the drop-down does); an unknown name is explained, nothing changes."""
        feedback = self.session.set_topic(name)
        if feedback.status != "invalid":
            self._syncing = True
            self.topic.value = self.session.topic or "all"
            self._syncing = False
            if self.session.current is None:
                self.next()
        return self._show_feedback(feedback)

    def _topic_changed(self, change) -> None:
        if not self._syncing:
            self.set_topic(change["new"])

    def next(self):
        """Show the next question (or the summary when the session is over)."""
        question = self.session.next()
        self.entry.value = self.essay.value = ""
        self.feedback.value = ""
        self.show(question)
        return question

    # ---- drawing ----

    def show(self, question) -> None:
        """Draw a question (any Question, also one made outside the session, e.g. by a test)."""
        self._header()
        if question is None:
            self.question.value = "<b>Session over.</b>"
            for part in (self.entry, self.essay, self.buttons, self.grades):
                part.layout.display = "none"
            self.summary.value = "<pre>" + html.escape(self.session.summary_text()) + "</pre>"
            return
        self.summary.value = ""
        self.question.value = question_html(question)
        is_card = question.card is not None
        self.entry.layout.display = "none" if is_card else None
        self.essay.layout.display = None if is_card else "none"
        self.buttons.layout.display = None
        self.grades.layout.display = "none"
        self.check_button.disabled = self.skip_button.disabled = False
        self.next_button.disabled = True

    def _show_feedback(self, feedback: Feedback) -> Feedback:
        if feedback.status == "quit":
            self.session.n = self.session.asked
            self.show(None)
        question = self.session.current
        revealed = question is not None and question.state == "revealed"
        done = question is None or question.state == "done"
        self.grades.layout.display = None if revealed else "none"
        self.check_button.disabled = revealed or done
        self.skip_button.disabled = done
        self.next_button.disabled = not done
        self.feedback.value = feedback_html(feedback)
        self.last = feedback
        self._header()
        return feedback

    def _header(self) -> None:
        s = self.session
        self.header.value = (f"<small>{s.right} of {s.asked} right, {s.asked} of {s.n} answered "
                             f"this session; seed {s.seed}; boxes in "
                             f"<code>{html.escape(str(s.store.path))}</code></small>")
