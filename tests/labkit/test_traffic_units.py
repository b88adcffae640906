"""labkit.runtime.traffic without ranks: a connection is found by its pair of addresses."""
from labkit.runtime import traffic


def _snap(sockets, owner):
    return traffic.Snapshot({i: traffic.Socket(l, p, sent, 0, sent) for i, (l, p, sent)
                             in sockets.items()}, owner, None)


def test_two_ranks_with_the_same_local_address_are_told_apart():
    # rank 0 and rank 1 both hold a socket on 127.0.0.1:5000 (rank 0's listener closed, rank 1
    # listened on the freed port); ranks 2 and 3 are connected to one each.
    before = _snap({1: ("127.0.0.1:5000", "127.0.0.1:6002", 0),
                    2: ("127.0.0.1:5000", "127.0.0.1:6003", 0),
                    3: ("127.0.0.1:6002", "127.0.0.1:5000", 0),
                    4: ("127.0.0.1:6003", "127.0.0.1:5000", 0)}, {1: 0, 2: 1, 3: 2, 4: 3})
    after = _snap({1: ("127.0.0.1:5000", "127.0.0.1:6002", 10),
                   2: ("127.0.0.1:5000", "127.0.0.1:6003", 20),
                   3: ("127.0.0.1:6002", "127.0.0.1:5000", 30),
                   4: ("127.0.0.1:6003", "127.0.0.1:5000", 40)}, {1: 0, 2: 1, 3: 2, 4: 3})
    matrix, outside, carried = traffic._between(before, after, 4)
    assert matrix[0][2] == 10 and matrix[1][3] == 20 and matrix[2][0] == 30 and matrix[3][1] == 40
    assert sum(map(sum, matrix)) == 100 and outside == [0, 0, 0, 0] and carried == 100


def test_dual_stack_addresses_are_read_as_ipv4():
    assert traffic._plain_address("[::ffff:127.0.0.1]:5000") == "127.0.0.1:5000"
    assert traffic._plain_address("127.0.0.1:5000") == "127.0.0.1:5000"


def test_a_mark_reached_in_two_waves_keeps_each_ranks_own_row():
    class _World:
        size, _measures, _broken, _closed = 2, [], None, False
    measure = traffic.Traffic(_World())
    measure._start = _snap({1: ("a:1", "b:1", 0), 2: ("b:1", "a:1", 0)}, {1: 0, 2: 1})
    measure.record_mark("m", _snap({1: ("a:1", "b:1", 5), 2: ("b:1", "a:1", 0)}, {1: 0, 2: 1}),
                        [0])
    measure.record_mark("m", _snap({1: ("a:1", "b:1", 9), 2: ("b:1", "a:1", 7)}, {1: 0, 2: 1}),
                        [1])
    assert measure.marks["m"]["sent"] == [5, 7]


def _sock(local, peer, sent=0, received=0):
    return traffic.Socket(local, peer, sent, received, sent)


def test_a_sender_closed_inside_the_interval_is_counted_from_its_receiver():
    # rank 0's socket 1 sent 100 bytes more to rank 1's socket 2, then closed before the end
    before = traffic.Snapshot({1: _sock("a:1", "b:1", 50), 2: _sock("b:1", "a:1", 0, 50)},
                              {1: 0, 2: 1}, None)
    after = traffic.Snapshot({2: _sock("b:1", "a:1", 0, 150)}, {2: 1}, None)
    counts = traffic.account(before, after, 2)
    assert counts.matrix[0][1] == 100 and counts.unaccounted == 0 and counts.lost == []


def test_a_closed_socket_still_sending_keeps_its_owner_by_its_address_pair():
    text = ("FIN-WAIT-1 0 0 127.0.0.1:7000 127.0.0.1:7001 ino:0 sk:1 <->\n"
            "\t ts sack bytes_sent:1500 bytes_retrans:100 bytes_received:7\n"
            "TIME-WAIT 0 0 127.0.0.1:7002 127.0.0.1:7003 ino:0 sk:2\n"
            "ESTAB 0 0 127.0.0.1:7001 127.0.0.1:7000 ino:9 sk:3 <->\n"
            "\t ts sack bytes_sent:0 bytes_received:1400\n")
    found = traffic.parse_ss(text)
    assert set(found) == {("closed", "127.0.0.1:7000", "127.0.0.1:7001"), 9}   # no TIME-WAIT
    before = traffic.Snapshot({8: _sock("127.0.0.1:7000", "127.0.0.1:7001", 400),
                               9: _sock("127.0.0.1:7001", "127.0.0.1:7000", 0, 400)},
                              {8: 0, 9: 1}, None)
    after = traffic.Snapshot(found, {9: 1}, None)
    assert traffic.account(before, after, 2).matrix[0][1] == 1400 - 400


def test_bytes_a_rank_received_from_no_ranks_sender_are_unaccounted():
    # socket 5 belongs to no rank (a process outside every rank's tree); socket 6 (the store the
    # measuring process hosts) is the launcher's and is not counted
    before = traffic.Snapshot({2: _sock("b:1", "x:1"), 5: _sock("x:1", "b:1"),
                               3: _sock("b:2", "s:1"), 6: _sock("s:1", "b:2")}, {2: 1, 3: 1},
                              None, frozenset({6}))
    after = traffic.Snapshot({2: _sock("b:1", "x:1", 0, 1000), 5: _sock("x:1", "b:1", 1000),
                              3: _sock("b:2", "s:1", 0, 30), 6: _sock("s:1", "b:2", 30)},
                             {2: 1, 3: 1}, None, frozenset({6}))
    counts = traffic.account(before, after, 2)
    assert counts.unaccounted == 1000 and counts.matrix == [[0, 0], [0, 0]]
    assert counts.carried == 0          # a socket of no rank never counts as carried


def test_private_network_bytes_of_no_ranks_socket_are_unaccounted():
    # under labkit grade: 2000 payload bytes crossed the loopback, 500 of them on rank sockets
    class _World:
        size, _measures, _broken, _closed = 2, [], None, False
    shots = iter([
        traffic.Snapshot({1: _sock("a:1", "b:1"), 7: _sock("u:1", "u:2")}, {1: 0}, (0, 0)),
        traffic.Snapshot({1: _sock("a:1", "b:1", 500), 7: _sock("u:1", "u:2", 1500)}, {1: 0},
                         (2000 + 10 * traffic.LOOPBACK_HEADER_BYTES, 10))])
    world = _World()
    world._traffic_snapshot = lambda: next(shots)
    with traffic.Traffic(world) as measure:
        pass
    assert measure.outside == [500, 0] and measure.unaccounted == 1500


def test_a_ranks_process_tree_holds_its_children_and_grandchildren():
    import os
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "g = subprocess.Popen(['sleep', '30']); print(g.pid, flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        tree = traffic.process_trees({3: os.getpid()})
        assert tree[os.getpid()] == tree[child.pid] == tree[grandchild] == 3
        assert 1 not in tree
    finally:
        child.kill()
        child.wait()
        os.kill(grandchild, 9)
