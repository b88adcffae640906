"""Grading that cannot be forged or dodged (issue 11): one crafted submission per class of attack
on the trust fixture lab (tests/grading/fixtures/make_trust_fixture.py), graded once, 2 at a time,
each with the exact score its code earned. ring_sum: values 2 points, traffic 1; async_sum 2."""
import os
import shutil

import pytest

from grading_helpers import FIXTURES, insert_cell, make_submission, needs_root_sandbox

pytestmark = [needs_root_sandbox(), pytest.mark.timeout(1200),
              pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")]
LAB = "labtrust"

RING = '''def ring_sum(tensor):
    P, rank = dist.get_world_size(), dist.get_rank()
    passing = tensor.clone()
    for _ in range(P - 1):
        incoming = torch.empty_like(passing)
        sending = dist.isend(passing, (rank + 1) % P)
        dist.irecv(incoming, (rank - 1) % P).wait()
        sending.wait()
        tensor.add_(incoming)
        passing = incoming
    return tensor'''
ASYNC = '''def async_sum(tensor, compute):
    work = dist.all_reduce(tensor, async_op=True)
    compute()
    work.wait()
    return tensor'''
STUB = 'def {name}(*args):\n    raise NotImplementedError("not done")'
DUMMY_RING = '''
    dummy = torch.zeros_like(tensor)
    for _ in range(P - 1):                            # messages of the ring's sizes, for show
        sending = dist.isend(dummy, (rank + 1) % P)
        dist.irecv(torch.empty_like(dummy), (rank - 1) % P).wait()
        sending.wait()
    return tensor'''

# class 1: the kernel's helper replaced; it hands over a function that needs no communication
FORGED_PLUMBING = '''import types, cloudpickle
import labkit.grading._kernel_side as real_helper
def answer_without_talking(tensor, *rest):
    tensor.mul_(dist.get_world_size())
    return tensor
forged = types.ModuleType("forged")
forged.export = lambda names: real_helper._send(
    {n: {"kind": "callable", "blob": cloudpickle.dumps(answer_without_talking)} for n in names})
__labkit_grading__ = forged'''
# class 2: every rank's input recomputed (the old deterministic rule), no communication
PREDICTED_INPUTS = '''def ring_sum(tensor):
    total = torch.zeros_like(tensor)
    for r in range(dist.get_world_size()):
        g = torch.Generator().manual_seed(1000 * r + tensor.numel())
        total += torch.randint(-20, 21, tensor.shape, generator=g).to(tensor.dtype)
    tensor.copy_(total)
    return tensor'''
# class 2: the other ranks' shares looked up in the checker's frames
FRAME_READER = '''def ring_sum(tensor):
    import gc, inspect
    found = []
    places = [f.frame.f_locals for f in inspect.stack()] + [o for o in gc.get_objects()
                                                             if isinstance(o, list)][:20000]
    for place in places:
        for value in (place.values() if isinstance(place, dict) else [place]):
            if (isinstance(value, list) and len(value) == dist.get_world_size()
                    and all(isinstance(v, torch.Tensor) and v.shape == tensor.shape for v in value)):
                found = value
    if found:
        tensor.copy_(torch.stack(found).sum(0))
    return tensor'''
# class 3: the work done by a collective, the records rewritten to look like a ring
FORGED_RECORDS = '''def ring_sum(tensor):
    dist.all_reduce(tensor)
    from labkit.runtime import hooks
    for record in list(hooks.STATE.records or []) + list(hooks.STATE.recent):
        record["op"] = "isend"
    return tensor'''
# class 3: the work through a ProcessGroup method the wrappers do not see, dummy ring messages
PROCESS_GROUP = '''def ring_sum(tensor):
    P, rank = dist.get_world_size(), dist.get_rank()
    dist.group.WORLD.allreduce([tensor]).wait()''' + DUMMY_RING
# class 3: the data through the rendezvous store, dummy ring messages
STORE = '''def ring_sum(tensor):
    import io
    from torch.distributed import distributed_c10d
    P, rank = dist.get_world_size(), dist.get_rank()
    store = distributed_c10d._get_default_store()
    call = (store.add("labkit-attack-calls", 1) - 1) // P
    buffer = io.BytesIO()
    torch.save(tensor.clone(), buffer)
    store.set(f"attack-{call}-{rank}", buffer.getvalue())
    total = torch.zeros_like(tensor)
    for r in range(P):
        total += torch.load(io.BytesIO(store.get(f"attack-{call}-{r}")))
    tensor.copy_(total)''' + DUMMY_RING
# class 3: a correct ring with a side channel of its own (UDP on the loopback)
SIDE_CHANNEL = RING.replace("    return tensor", '''    import socket
    side = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(20):
        side.sendto(b"x" * 1000, ("127.0.0.1", 9))
    return tensor''')
# class 4: no result at all
EMPTY = "def ring_sum(tensor):\n    return None"
# class 5: the reduction done in float32 (exact for small integers, wrong across the range)
NARROW = RING.replace("tensor.add_(incoming)",
                      "tensor.copy_((tensor.float() + incoming.float()).to(tensor.dtype))")
# class 6: communication only after the computation (nothing on the wire at the mark)
LAZY = '''def async_sum(tensor, compute):
    compute()
    dist.all_reduce(tensor)
    return tensor'''

SUBMISSIONS = {   # name: (ring answer, async answer, scratch cell, exact score)
    "correct": (RING, ASYNC, None, 5),
    "blank": (STUB.format(name="ring_sum"), STUB.format(name="async_sum"), None, 0),
    "forged_plumbing": (STUB.format(name="ring_sum"), STUB.format(name="async_sum"),
                        FORGED_PLUMBING, 0),
    "predicted_inputs": (PREDICTED_INPUTS, ASYNC, None, 2),
    "frame_reader": (FRAME_READER, ASYNC, None, 2),
    "forged_records": (FORGED_RECORDS, ASYNC, None, 4),
    "process_group": (PROCESS_GROUP, ASYNC, None, 4),
    "store": (STORE, ASYNC, None, 4),
    "side_channel": (SIDE_CHANNEL, ASYNC, None, 4),
    "empty": (EMPTY, ASYNC, None, 2),
    "narrow": (NARROW, ASYNC, None, 2),
    "lazy": (RING, LAZY, None, 3),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    from labkit.grading import grade
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(os.path.join(FIXTURES, "solutions", LAB), course / "solutions" / LAB)
    subs = tmp_path_factory.mktemp("submissions")
    for student, (ring, overlap, scratch, _) in SUBMISSIONS.items():
        make_submission(str(course), str(subs), student, lab=LAB,
                        solved={"task_ring": ring, "task_async": overlap},
                        edit=(lambda nb, code=scratch: insert_cell(nb, "setup", code))
                        if scratch else None)
    out = str(tmp_path_factory.mktemp("out"))
    return grade(LAB, str(subs), jobs=2, out=out, course=str(course), time_limit=240,
                 cell_timeout=30)


def test_each_attack_class_earns_exactly_what_its_code_does(graded):
    got = graded.scores
    expected = {s: float(v[3]) for s, v in SUBMISSIONS.items()}
    wrong = {s: (got.get(s), expected[s]) for s in expected if got.get(s) != expected[s]}
    assert not wrong, f"(score, expected) per submission that differs: {wrong}"
    assert all(r.max_score == 5 for r in graded.results)


def test_the_correct_submission_has_no_problem(graded):
    problems = {r.student: r.problems for r in graded.results}
    assert problems["correct"] == []
