"""The backlog's order (megatrain.runtime.deadlines): regions reach the host optimizer
earliest deadline first, ready ones before any still copying; without deadlines, in
arrival order. Through the backend: tests/compiler/test_backlog.py."""

from __future__ import annotations

import threading

from megatrain.runtime.deadlines import SERVED_KEPT, DeadlineQueue, Deadlines


def _forward(order):
    deadlines = Deadlines()
    for region in order:
        deadlines.learn(region)
    return deadlines


def test_the_region_the_forward_fetches_first_is_served_first():
    q = DeadlineQueue(_forward([0, 1, 2, 3, 4, 5, 2]))  # 2 fetched again later: its first fetch counts
    for region in [5, 4, 3]:  # backward: last layer first
        q.push(region, f"r{region}", nbytes=10)
    assert q.bytes == 30 and q.peek() == 3
    assert q.pop() == (3, "r3")
    q.push(1, "r1", nbytes=10)
    q.push(9, "r9", nbytes=10)  # never fetched in a forward: last
    q.push(0, "r0", nbytes=10)
    assert [q.pop()[0] for _ in range(len(q))] == [0, 1, 4, 5, 9]
    assert q.bytes == 0 and q.pop() is None
    q.push(4, {"first": 1})  # the same region twice (a graph run for several modules)
    q.push(4, {"second": 2})
    assert [q.pop()[1] for _ in range(2)] == [{"first": 1}, {"second": 2}]
    assert list(q.served)[:3] == [(3, (4, 5)), (0, (1, 4, 5, 9)), (1, (4, 5, 9))]


def test_the_deadline_is_the_forward_order_not_the_region_id():
    q = DeadlineQueue(_forward([3, 0, 2]))
    for region in [0, 2, 3]:
        q.push(region, None)
    assert [q.pop()[0] for _ in range(3)] == [3, 0, 2]


def test_a_ready_region_goes_before_an_earlier_one_still_copying():
    copied = {0: False, 1: True, 2: True}
    q = DeadlineQueue(_forward([0, 1, 2]))
    for region in [2, 1, 0]:
        q.push(region, None, ready=lambda r=region: copied[r])
    assert q.pop()[0] == 1, "region 0's copy is not done: the host updates region 1 meanwhile"
    copied[0] = True
    assert [q.pop()[0] for _ in range(2)] == [0, 2]
    for region in [2, 0]:
        copied[region] = False
        q.push(region, None, ready=lambda r=region: copied[r])
    assert q.pop()[0] == 0, "none ready: the earliest deadline, whose copy is waited for"


def test_without_deadlines_arrival_order_whatever_is_ready():
    q = DeadlineQueue(None)
    for region in [5, 0, 3]:
        q.push(region, None, ready=lambda r=region: r != 5)
    assert [q.pop()[0] for _ in range(3)] == [5, 0, 3]


def test_the_served_log_is_bounded():
    q = DeadlineQueue(_forward(range(4)))
    for i in range(SERVED_KEPT + 10):
        q.push(i % 4, i)
        q.pop()
    assert len(q.served) == SERVED_KEPT


def test_pushes_and_pops_from_two_threads_lose_nothing():
    q = DeadlineQueue(_forward(range(100)))
    popped = []

    def pop_all():
        while len(popped) < 400:
            got = q.pop()
            if got is not None:
                popped.append(got[1])

    consumer = threading.Thread(target=pop_all)
    consumer.start()
    for i in range(400):
        q.push(i % 100, i, nbytes=1)
    consumer.join(timeout=30)
    assert sorted(popped) == list(range(400)) and q.bytes == 0
