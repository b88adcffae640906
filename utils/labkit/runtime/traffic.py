"""Kernel side: bytes the ranks sent to each other, counted from outside the rank processes.

    with world.traffic() as traffic:
        world.run_each(program, shares)
    traffic.sent[r]          # TCP payload bytes rank r sent during the calls inside
    traffic.matrix[r][q]     # ... of which to rank q
    traffic.outside[r]       # ... to sockets that belong to no rank (a store, anything else)
    traffic.marks[label]     # the matrix as it was when every rank reached labkit.mark(label)
    traffic.unaccounted      # bytes that reached the ranks' network but no rank can be named
                             # as their sender (see below)
    traffic.lost             # connections of a rank that closed inside the calls with both
                             # ends gone: their last bytes could not be read (plain worlds)

Where the numbers come from: the operating system's own counters, read by this process. A rank
is its process and every process it started (its process tree: a child forked by the rank's code
sends on the rank's behalf); their open sockets are found in /proc/<pid>/fd, before and again
after the counters are read, so that a socket opened or closed while they are read still has its
owner. The kernel's TCP counters of every socket (`bytes_sent` of tcp_info, as `ss -ti` prints
them) say what it carried; a socket's peer address names the rank at the other end. A connection
whose sending end closed inside the call is counted from its receiving end (`bytes_received`).
Nothing here asks a rank anything, so code running on a rank cannot change what is counted.

`unaccounted`: bytes a rank's socket received from a sender that is no rank's (a socket of a
process outside every rank's tree, or one that closed before it could be named). Under `labkit
grade` the ranks have a network namespace of their own, and its loopback counters also catch
bytes that went another way (a connection opened and closed within the call, UDP): there
`unaccounted` is at least the loopback's payload less what the rank sockets carried.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time

_ADDRESS = re.compile(r"^(?:ESTAB|\S+)\s+\d+\s+\d+\s+(\S+)\s+(\S+)")
_FIELD = re.compile(r"\b(ino|bytes_sent|bytes_retrans|bytes_received):(\d+)")
# per packet on loopback: ethernet (14) + IPv4 (20) + TCP with timestamps (32)
LOOPBACK_HEADER_BYTES = 66


class TrafficError(RuntimeError):
    """The counters cannot be read here (no `ss`, or no permission)."""


@dataclasses.dataclass
class Socket:
    local: str
    peer: str
    sent: int          # payload bytes sent, each once
    received: int
    wire: int = 0      # payload bytes put on the wire, retransmissions included


def available() -> tuple[bool, str]:
    if shutil.which("ss") is None:
        return False, "`ss` (Debian's iproute2) is not installed"
    if not os.path.exists("/proc/self/fd"):
        return False, "no /proc: not Linux"
    return True, "ss and /proc available"


def sockets(netns_pid: int | None = None) -> dict[int, Socket]:
    """{inode: Socket} for every TCP socket of the network namespace of `netns_pid` (this one by
    default), from the kernel's tcp_info counters."""
    command = ["ss", "-tinHe"]
    if netns_pid is not None:
        command = ["nsenter", f"--net=/proc/{netns_pid}/ns/net"] + command
    try:
        text = subprocess.run(command, capture_output=True, text=True, timeout=20,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise TrafficError(f"cannot read socket counters with {' '.join(command)}: {error}") \
            from None
    return parse_ss(text)


def parse_ss(text: str) -> dict:
    """{key: Socket} from the text of `ss -tinHe`: key is the socket's inode, or ("closed",
    local, peer) for a socket no process holds any more that still has counters."""
    found, current, counted = {}, None, set()
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            match = _ADDRESS.match(line)
            current = None
            if match:
                fields = dict(_FIELD.findall(line))
                local, peer = _plain_address(match.group(1)), _plain_address(match.group(2))
                # ino 0: no process holds the socket any more. A TIME-WAIT one has no counters
                # (no info line follows); one still sending its last bytes (FIN-WAIT, LAST-ACK)
                # has, and is kept under its address pair: the connection it was is found by it
                current = int(fields.get("ino", 0)) or ("closed", local, peer)
                found[current] = Socket(local, peer, 0, 0)
            continue
        if current is None:
            continue
        fields = dict(_FIELD.findall(line))
        # what the connection carried once: a segment sent again (a retransmission, which a
        # loaded machine can cause even on loopback) is not counted twice
        found[current].wire = int(fields.get("bytes_sent", 0))
        found[current].sent = found[current].wire - int(fields.get("bytes_retrans", 0))
        found[current].received = int(fields.get("bytes_received", 0))
        counted.add(current)
    # a TIME-WAIT socket has no counters left: keeping it would read as a socket that sent 0
    return {key: sock for key, sock in found.items() if key in counted or isinstance(key, int)}


def _plain_address(address: str) -> str:
    """127.0.0.1:5000 for [::ffff:127.0.0.1]:5000 (an IPv4 peer of a dual-stack socket)."""
    if address.startswith("[::ffff:"):
        host, _, port = address[len("[::ffff:"):].partition("]:")
        return f"{host}:{port}"
    return address


def process_trees(pids: dict) -> dict:
    """{pid: rank} for every process of every rank's tree: the rank's process and all its
    descendants (children, grandchildren, ...), from the parent ids in /proc/<pid>/stat.
    pids: {rank: pid}. A process that left its tree (re-parented when its parent died) is no
    rank's: what it sends a rank counts as unaccounted."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue                         # exited while we looked
        # the name field may hold spaces and parentheses: the fields after its last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    rank_of = {}
    for rank, pid in pids.items():
        todo = [pid]
        while todo:
            current = todo.pop()
            if current in rank_of:
                continue
            rank_of[current] = rank
            todo.extend(children.get(current, ()))
    return rank_of


def socket_owners(pids: dict) -> dict:
    """{socket inode: rank} for the sockets the processes of every rank's tree hold open."""
    owner = {}
    for pid, rank in process_trees(pids).items():
        for inode in socket_inodes(pid):
            owner.setdefault(inode, rank)
    return owner


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open (threads share them)."""
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def loopback_counters(netns_pid: int) -> tuple[int, int]:
    """(tx bytes, tx packets) of the loopback interface of `netns_pid`'s network namespace."""
    with open(f"/proc/{netns_pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                fields = rest.split()
                return int(fields[8]), int(fields[9])
    raise TrafficError(f"no loopback interface in the network namespace of pid {netns_pid}")


@dataclasses.dataclass
class Snapshot:
    sockets: dict          # inode -> Socket
    owner: dict            # inode -> rank
    loopback: tuple | None  # (tx bytes, tx packets) of a private network namespace
    launcher: frozenset = frozenset()   # inodes the measuring process holds (the store it hosts)


def snapshot(pids: dict, netns_pid: int | None = None, private_network: bool = False) -> Snapshot:
    """The counters now. pids: {rank: pid}. Owners are read before and after the counters: a
    socket opened while `ss` runs, or closed just after it read the socket, still has one."""
    owner = socket_owners(pids)
    socks = sockets(netns_pid)
    for inode, rank in socket_owners(pids).items():
        owner.setdefault(inode, rank)
    loopback = loopback_counters(netns_pid) if private_network and netns_pid else None
    return Snapshot(socks, owner, loopback, frozenset(socket_inodes(os.getpid())))


@dataclasses.dataclass
class Account:
    """What two snapshots say: see `account`."""
    matrix: list           # matrix[r][q]: payload bytes rank r sent rank q
    outside: list          # outside[r]: ... to sockets of no rank
    carried: int           # wire bytes (retransmissions included) of the ranks' connections
    unaccounted: int       # bytes rank sockets received from a sender no rank can be named for
    lost: list             # (rank, local, peer): a rank's connection gone with both its ends


def account(before: Snapshot, after: Snapshot, size: int) -> Account:
    """Every connection a rank held during the interval, counted once, from two snapshots.

    A connection is its pair of addresses: the other end of (local, peer) is (peer, local). (A
    local address alone is not enough: once a listener has closed, another rank may listen on
    the same port, and two processes then hold sockets with the same local address.) Its bytes
    are what its sending end sent (`sent`, each byte once); when that end closed inside the
    interval, what its receiving end received. Nothing a rank's socket received is dropped: a
    sender that is no rank's makes it `unaccounted`."""
    matrix = [[0] * size for _ in range(size)]
    outside = [0] * size
    carried = unaccounted = 0
    lost = []

    def owner(key):
        return after.owner.get(key, before.owner.get(key))

    after_by_pair = {(s.local, s.peer): key for key, s in after.sockets.items()}
    before_by_pair = {(s.local, s.peer): key for key, s in before.sockets.items()}

    def now(key, sock):
        """This socket's counters in `after` (by inode, or closed and kept under its pair)."""
        if key in after.sockets:
            return after.sockets[key]
        closed = after.sockets.get(("closed", sock.local, sock.peer))
        return closed

    def end_of(sock):
        """The other end of a connection: (key, socket in after or None, socket in before)."""
        pair = (sock.peer, sock.local)
        key = after_by_pair.get(pair, before_by_pair.get(pair))
        if key is None:
            return None, None, None
        earlier = before.sockets.get(key)
        later = after.sockets.get(key)
        if later is None and earlier is not None:
            later = now(key, earlier)
        return key, later, earlier

    # 1. every socket with counters at the end: what it sent since the start
    counted = set()
    for key, sock in after.sockets.items():
        earlier = before.sockets.get(key)
        if earlier is None and isinstance(key, tuple):
            earlier = before.sockets.get(before_by_pair.get((sock.local, sock.peer)))
        rank = owner(key)
        if rank is None and isinstance(key, tuple):           # closed: its owner at the start
            rank = owner(before_by_pair.get((sock.local, sock.peer)))
        if rank is None:
            continue                       # no rank's: what it sent a rank is found in step 3
        counted.add((sock.local, sock.peer))
        carried += max(0, sock.wire - (earlier.wire if earlier is not None else 0))
        delta = sock.sent - (earlier.sent if earlier is not None else 0)
        if delta <= 0:
            continue
        peer_key, _, _ = end_of(sock)
        peer = None if peer_key is None else owner(peer_key)
        if peer is None:
            outside[rank] += delta
        else:
            matrix[rank][peer] += delta
    # 2. a rank's socket gone by the end (closed, its counters with it): its bytes since the start
    # are what the other end received, where that end is still there
    for key, sock in before.sockets.items():
        rank = owner(key)
        if rank is None or (sock.local, sock.peer) in counted:
            continue
        if now(key, sock) is not None:
            continue
        _, peer_now, peer_then = end_of(sock)
        if peer_now is None:
            lost.append((rank, sock.local, sock.peer))
            continue
        got = peer_now.received - (peer_then.received if peer_then is not None else 0)
        if got > 0:
            peer = owner(after_by_pair.get((sock.peer, sock.local)))
            carried += got
            counted.add((sock.local, sock.peer))
            if peer is None:
                outside[rank] += got
            else:
                matrix[rank][peer] += got
    # 3. what rank sockets received from a sender no rank can be named for: a process outside
    # every rank's tree, or one whose socket closed before it was seen (opened and closed inside
    # the interval). Only the measuring process's own sockets (the store it hosts) are not.
    for key, sock in after.sockets.items():
        if owner(key) is None or (sock.peer, sock.local) in counted:
            continue
        peer_key, _, _ = end_of(sock)
        if peer_key is not None and peer_key in after.launcher:
            continue
        earlier = before.sockets.get(key)
        got = sock.received - (earlier.received if earlier is not None else 0)
        unaccounted += max(0, got)
    return Account(matrix, outside, carried, unaccounted, lost)


def _between(before: Snapshot, after: Snapshot, size: int):
    """matrix[r][q], outside[r], and the bytes the ranks' connections put on the wire
    (retransmissions included, as the interface counters count them), from two snapshots."""
    counts = account(before, after, size)
    return counts.matrix, counts.outside, counts.carried


class Traffic:
    """What `world.traffic()` returns; filled in when the `with` block ends."""

    def __init__(self, world):
        self.world = world
        self.size = world.size
        self.matrix = [[0] * self.size for _ in range(self.size)]
        self.outside = [0] * self.size
        self.marks: dict = {}
        self.unaccounted = None
        self.lost: list = []
        self.complete = False
        self._start = None

    # ---- what checkers read ---------------------------------------------------------------
    @property
    def sent(self) -> list:
        return [sum(row) + out for row, out in zip(self.matrix, self.outside)]

    def to(self, rank: int, peer: int) -> int:
        return self.matrix[rank][peer]

    def peers(self, rank: int, at_least: int = 1) -> list:
        """The ranks `rank` sent at least `at_least` bytes to."""
        return [q for q, count in enumerate(self.matrix[rank]) if count >= at_least]

    def table(self) -> str:
        """The matrix as text: rows send, columns receive."""
        width = max(8, len(str(max((max(r) for r in self.matrix), default=0))) + 2)
        head = "from\\to " + "".join(f"{'rank ' + str(q):>{width}}" for q in range(self.size))
        rows = [head + f"{'outside':>{width}}"]
        for r in range(self.size):
            rows.append(f"rank {r:<3}" + "".join(f"{c:>{width}}" for c in self.matrix[r])
                        + f"{self.outside[r]:>{width}}")
        if self.unaccounted is not None:
            rows.append(f"bytes on the network no rank can be named as the sender of: "
                        f"{self.unaccounted}")
        if self.lost:
            rows.append(f"connections closed inside the call whose last bytes could not be "
                        f"read: {len(self.lost)}")
        return "\n".join(rows)

    def __repr__(self):
        return f"Traffic(sent={self.sent}, complete={self.complete})"

    # ---- measuring (called by the world) ----------------------------------------------------
    def _take(self) -> Snapshot:
        return self.world._traffic_snapshot()

    def __enter__(self):
        self._start = self._take()
        self.world._measures.append(self)
        return self

    def record_mark(self, label: str, snap: Snapshot, ranks=None):
        """The counts at a mark, for the ranks that reached it in this wave (`ranks`; all by
        default): a rank that reaches it later gets its own row from a later snapshot. A rank's
        first row of a label is kept. A rank that reaches a label twice in one call, or a call
        with more than 64 labels, fails the call (the world restarts on the next one): a mark is
        the measuring program's, and a second one could only move the measured point."""
        from labkit.errors import LabkitError
        call = id(getattr(self.world, "_finished", None))     # a new dict for every call
        state = self.__dict__.setdefault("_mark_state", {"call": None, "labels": {}, "rows": {}})
        if state["call"] != call:
            state["call"], state["labels"] = call, {}
        targets = list(range(self.size)) if ranks is None else [int(r) for r in ranks]
        reached = state["labels"].setdefault(label, set())
        again = sorted(set(targets) & reached)
        if again or len(state["labels"]) > 64:
            self.world._broken = "a labkit.mark was refused"
            what = (f"ranks {again} reached labkit.mark({label!r}) a second time in one call; "
                    "expected each label once per rank per call" if again else
                    f"the call reached {len(state['labels'])} labkit.mark labels (at most 64; "
                    f"the last one {label!r})")
            raise LabkitError(f"{what}. A mark belongs to the program that measures the call: "
                              "do not call labkit.mark from your own code. The world restarts "
                              "on the next call.")
        reached.update(targets)
        filled = state["rows"].setdefault(label, set())
        targets = [r for r in targets if r not in filled]        # the first row of a rank stays
        filled.update(targets)
        matrix, outside, _ = _between(self._start, snap, self.size)
        entry = self.marks.setdefault(label, {"matrix": [[0] * self.size for _ in matrix],
                                              "outside": [0] * self.size,
                                              "sent": [0] * self.size})
        for r in targets:
            entry["matrix"][r] = matrix[r]
            entry["outside"][r] = outside[r]
            entry["sent"][r] = sum(matrix[r]) + outside[r]

    def __exit__(self, *exc):
        self.world._measures.remove(self)
        if self.world._broken or self.world._closed:
            return False       # ranks restarted: their sockets are gone, the counts incomplete
        end = self._take()
        counts = account(self._start, end, self.size)
        self.matrix, self.outside, self.lost = counts.matrix, counts.outside, counts.lost
        self.unaccounted = counts.unaccounted
        if self._start.loopback is not None and end.loopback is not None:
            data = end.loopback[0] - self._start.loopback[0]
            packets = end.loopback[1] - self._start.loopback[1]
            payload = max(0, data - LOOPBACK_HEADER_BYTES * packets)
            self.unaccounted = max(self.unaccounted, payload - counts.carried)
        self.complete = True
        return False


def settle(take, seconds: float = 1.0, step: float = 0.03) -> Snapshot:
    """A snapshot once the counters stopped moving (or after `seconds`): in-flight work of
    asynchronous collectives finishes sending before a mark is recorded."""
    deadline = time.monotonic() + seconds
    last = take()
    while time.monotonic() < deadline:
        time.sleep(step)
        now = take()
        if all(now.sockets.get(i) is not None and now.sockets[i].sent == s.sent
               for i, s in last.sockets.items()) and len(now.sockets) == len(last.sockets):
            return now
        last = now
    return last
