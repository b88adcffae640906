"""Lab 1, tasks 1 and 3 (issue 32): task 1 states the ring's invariants, not each send's chunk
index; task 3 is the uneven all_to_all_single of a mixture-of-experts dispatch, judged on real
ranks by its rows and by the bytes the OS counted on every pair, plus its alpha-beta time.
Each wrong answer runs alone through the lab's own test cells (visible and hidden lines, outside
nbgrader) and must fail exactly the cell of its mistake."""
import json
import re
import types

import pytest
import torch

import lab_notebooks
import labkit
from labkit import checks as lab_checks
from labkit.collectives import checks

LAB = "lab01_collectives"
TASK3 = ["test_task3_all_to_all_rows", "test_task3_all_to_all_seconds"]


@pytest.fixture(scope="module", autouse=True)
def _close_worlds():
    yield
    labkit.shutdown_all()


def _answer(grade_id):
    return lab_notebooks.answer(LAB, grade_id)


def _failed(answers, tests=TASK3):
    outcome = lab_notebooks.run_lab(LAB, tests, answers)
    return {test for test, error in outcome.items() if error is not None}, outcome


# ---- task 1: the invariant, not the indices ----------------------------------------------------

STEP_INDICES = [r"\(r - s\) mod P", r"\(r - s - 1\) mod P", r"\(r \+ 1 - s\) mod P",
                r"chunk `\(r - k\) mod P`", r"\(r \+ 1 - k\)", r"rank - step"]


def test_the_student_copy_of_task_1_states_invariants_not_send_indices():
    copy = lab_notebooks.ROOT / "labs" / LAB / f"{LAB}.ipynb"
    cells = json.loads(copy.read_text())["cells"]
    text = "\n".join("".join(cell["source"]) for cell in cells)
    task1 = text[text.index("## Task 1"):text.index("## Task 2")]
    assert "invariant" in task1 and "after step k" in task1
    for pattern in STEP_INDICES:
        assert not re.search(pattern, task1), f"the student copy still spells out {pattern}"


def test_the_ring_payload_follows_from_the_invariants_at_every_p():
    """What each rank passes on, from the invariants (all chunks but the one it finishes, then
    all but the one its right neighbour finished), against a step-by-step walk of the solution's
    indices: the same bytes and messages for P = 1..8 and every length to 40."""
    for P in range(1, 9):
        for length in range(41):
            sizes = checks._chunk_sizes(length, P)
            data = [[0] * P for _ in range(P)]
            messages = [[0] * P for _ in range(P)]
            for r in range(P):
                for s in range(P - 1):
                    for chunk in ((r - s) % P, (r + 1 - s) % P):
                        data[r][(r + 1) % P] += sizes[chunk] * 4
                        messages[r][(r + 1) % P] += 1 if sizes[chunk] else 0
            assert checks.ring_payload(length, P, 4) == (data, messages), (P, length)


# ---- task 3, the exchange: rows and bytes on the same call ------------------------------------

PADDED_TO_CAPACITY = '''
def all_to_all_rows(rows, dest):
    """Every block padded to the largest one (a fixed capacity): the right rows, too many bytes."""
    P = dist.get_world_size()
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    capacity = send.max().reshape(1)
    dist.all_reduce(capacity, op=dist.ReduceOp.MAX)
    C, H = int(capacity), rows.shape[1]
    padded = rows.new_zeros(P * C, H)
    start = 0
    for q, n in enumerate(send.tolist()):
        padded[q * C:q * C + n] = rows[order][start:start + n]
        start += n
    out = rows.new_empty(P * C, H)
    dist.all_to_all_single(out, padded)
    return torch.cat([out[q * C:q * C + n] for q, n in enumerate(recv.tolist())])
'''

GATHER_EVERYTHING = '''
def all_to_all_rows(rows, dest):
    """Every row sent to every rank, each keeps its own: the right rows, P - 1 times the bytes."""
    P, rank = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(P)]
    dist.all_gather(sizes, torch.tensor([rows.shape[0]]))
    mine = []
    for q in range(P):
        n = int(sizes[q])
        theirs = rows.clone() if q == rank else rows.new_empty(n, rows.shape[1])
        theirs_dest = dest.clone() if q == rank else dest.new_empty(n)
        dist.broadcast(theirs, src=q)
        dist.broadcast(theirs_dest, src=q)
        mine.append(theirs[theirs_dest == rank])
    return torch.cat(mine)
'''


@pytest.mark.timeout(400)
def test_the_solution_keeps_task_3_and_each_exchange_mistake_loses_only_its_cell():
    solution = _answer("task3_all_to_all")
    failed, outcome = _failed(None)
    assert failed == set(), outcome
    unsorted = solution.replace("rows[order].contiguous()", "rows.contiguous()")
    assert unsorted != solution
    for name, source, fails in [
        ("blocks padded to a common capacity", lambda s: s.replace(
            s[:s.index("def all_to_all_seconds")], PADDED_TO_CAPACITY + "\n\n"), "traffic"),
        ("every row sent everywhere", lambda s: s.replace(
            s[:s.index("def all_to_all_seconds")], GATHER_EVERYTHING + "\n\n"), "traffic"),
        ("rows sent in their original order", lambda s: unsorted, "order"),
        ("own rows dropped", lab_notebooks.wrong_answers(LAB).OWN_BLOCK, "rows"),
    ]:
        wrong = source(solution)
        assert wrong != solution, name
        failed, outcome = _failed({"task3_all_to_all": wrong}, ["test_task3_all_to_all_rows",
                                                                 "test_task3_all_to_all_seconds"])
        assert failed == {"test_task3_all_to_all_rows"}, f"{name}: {outcome}"
        message = str(outcome["test_task3_all_to_all_rows"])
        expected_words = {"traffic": "traffic between ranks", "order": "stable sort",
                          "rows": "were routed here"}[fails]
        assert expected_words in message, f"{name}: {message[:600]}"


def test_the_exchange_check_refuses_a_teaching_world_and_its_tables_have_the_adversarial_blocks():
    with pytest.raises(ValueError, match="teaching=False"):
        checks.check_uneven_all_to_all(types.SimpleNamespace(teaching=True, size=3),
                                       lambda rows, dest: rows)
    # the routing tables: an empty block off the diagonal, a popular receiver, for every P
    for P in (2, 3, 4):
        for pattern in ("random", "hot"):
            counts = checks.routing_table(lab_checks.Case("table"), P, pattern)
            assert any(counts[r][q] == 0 for r in range(P) for q in range(P) if q != r)
            columns = [sum(counts[r][q] for r in range(P)) for q in range(P)]
            assert max(columns) >= 24 * (P - 1 if pattern == "hot" and P >= 3 else P)


# ---- task 3, the time: which messages exist, and who finishes last ----------------------------

def _seconds_swap(old, new):
    solution = _answer("task3_all_to_all")
    assert old in solution, "the solution changed; update this test"
    return solution.replace(old, new)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, old, new", [
    ("only the senders' bytes (a popular receiver missed)",
     "    busiest = max(max(s, g) for s, g in zip(sent, received))",
     "    busiest = max(sent)"),
    ("the average rank instead of the busiest (the even formula)",
     "    busiest = max(max(s, g) for s, g in zip(sent, received))",
     "    busiest = sum(sent) / P"),
    ("no latency for an empty block (gloo sends its header anyway)",
     "    messages = P - 1                                         # gloo sends every block, empty ones too",
     "    messages = max(sum(1 for q in range(P) if q != r and counts[r][q]) for r in range(P))"),
    ("the block a rank keeps counted as sent",
     "    sent = [sum(counts[r][q] for q in range(P) if q != r) * row_bytes for r in range(P)]",
     "    sent = [sum(counts[r]) * row_bytes for r in range(P)]"),
    ("one latency for the whole exchange", "    return messages * alpha + busiest * beta",
     "    return (alpha if messages else 0) + busiest * beta"),
])
def test_each_seconds_mistake_loses_only_the_seconds_cell(name, old, new):
    failed, outcome = _failed({"task3_all_to_all": _seconds_swap(old, new)},
                              ["test_task3_all_to_all_seconds"])
    assert failed == {"test_task3_all_to_all_seconds"}, f"{name}: {outcome}"


def test_the_seconds_model_is_the_even_formula_on_an_even_table():
    namespace = lab_notebooks.answer_cells(LAB, torch=torch, dist=None, math=__import__("math"))
    seconds = namespace["all_to_all_seconds"]
    for P in (2, 3, 5, 8):
        n = 4096 * P                                        # bytes per rank, P blocks of 4096
        even = [[1] * P for _ in range(P)]
        assert seconds(even, 4096, 1e-5, 1e-9) == pytest.approx(
            (P - 1) * (1e-5 + n / P * 1e-9), rel=1e-12)


CHAPTER_7_HELPERS = {
    "imported": '''
from labkit.moe.ep import all_to_all, exchange_counts
def all_to_all_rows(rows, dest):
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=dist.get_world_size()).tolist()
    return all_to_all(rows[order], send, exchange_counts(send))
''',
    "by attribute": '''
def all_to_all_rows(rows, dest):
    from labkit.moe import ep
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=dist.get_world_size()).tolist()
    return ep.all_to_all(rows[order], send, ep.exchange_counts(send))
''',
}


@pytest.mark.parametrize("how", sorted(CHAPTER_7_HELPERS))
def test_chapter_7s_dispatch_helpers_do_not_answer_task_3(how):
    """labkit.moe.ep ships in the student copy (chapter 7 uses it): calling its exchange_counts
    and all_to_all does task 3's work. The rows cell refuses it, whether imported by name or
    reached as an attribute, and says why; the seconds cell is not touched."""
    failed, outcome = _failed({"task3_all_to_all": _answer("task3_all_to_all") + CHAPTER_7_HELPERS[how]})
    assert failed == {"test_task3_all_to_all_rows"}, outcome
    assert "chapter 7's finished version" in str(outcome["test_task3_all_to_all_rows"])
