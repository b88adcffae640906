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
