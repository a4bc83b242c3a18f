"""Binding CPU ranks to cores of their own (runtime/affinity.py)."""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Any

import pytest

from runtime.affinity import bind_local_rank, bound_as_local_rank, cpu_share

two_cores = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs 2 cores this process may use")


def test_each_rank_gets_a_contiguous_share() -> None:
    cores = {0, 1, 2, 3, 4, 5, 6}
    assert [cpu_share(cores, r, 3) for r in range(3)] == [{0, 1}, {2, 3}, {4, 5}]  # core 6 left over
    assert cpu_share({4, 9}, 1, 2) == {9}
    assert cpu_share({0, 1}, 0, 1) == {0, 1}


def test_fewer_cores_than_ranks_is_no_share() -> None:
    assert cpu_share({0, 1}, 0, 4) is None
    assert cpu_share({0, 1}, 2, 2) is None
    assert cpu_share({0, 1}, 0, 0) is None


def _in_child(target: Any, *args: Any) -> Any:
    """target(*args) in a forked child (its affinity changes stay there); its result."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=lambda: child.send(target(*args)))
    proc.start()
    try:
        assert parent.poll(30), "the child did not answer"
        return parent.recv()
    finally:
        proc.join(5)


def _bind_with_a_thread(rank: int, world: int, setting: str) -> tuple[Any, list[list[int]]]:
    os.environ["PIPELINE_CPU_BIND"] = setting
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)  # started before binding, as gloo's threads are
    helper.start()
    try:
        share = bind_local_rank(rank, world)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        return share, sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tids})  # type: ignore[misc]
    finally:
        stop.set()
        helper.join()


@two_cores
def test_every_thread_is_bound_to_the_ranks_share() -> None:
    cores = sorted(os.sched_getaffinity(0))
    share, affinities = _in_child(_bind_with_a_thread, 1, 2, "1")
    mine = cpu_share(set(cores), 1, 2)
    assert share == mine
    assert affinities == [tuple(sorted(mine))]  # the main thread and the one started before


@two_cores
@pytest.mark.parametrize("rank, world, setting", [(0, 2, "0"), (0, 2, "off"), (0, 1, "1")])
def test_nothing_is_bound_when_off_or_alone(rank: int, world: int, setting: str) -> None:
    share, affinities = _in_child(_bind_with_a_thread, rank, world, setting)
    assert share is None
    assert affinities == [tuple(sorted(os.sched_getaffinity(0)))]


def _bound_then_back() -> tuple[Any, list[int], list[int]]:
    os.environ.pop("PIPELINE_CPU_BIND", None)
    with bound_as_local_rank(0, 2) as share:
        inside = sorted(os.sched_getaffinity(0))
    return share, inside, sorted(os.sched_getaffinity(0))


@two_cores
def test_bound_for_a_while_then_given_back() -> None:
    share, inside, after = _in_child(_bound_then_back)
    assert inside == sorted(share) and len(inside) < len(after)
    assert after == sorted(os.sched_getaffinity(0))
