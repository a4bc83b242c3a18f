"""What each edge carries (runtime/edges.py): made once per package, the same as derived per message."""

from __future__ import annotations

from typing import Any, Callable

from runtime import edges, messages, package


def test_an_edge_is_made_once_and_matches_the_manifest(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny(stages=3)
    m = package.load_manifest(tiny.dir)
    made = edges.Edges(m)
    for p, c in [(0, 1), (1, 2)]:
        for forward in (True, False):
            edge = made.get(p, c, forward)
            assert made.get(p, c, forward) is edge  # made once
            want = edges.edge_values(m, p, c) if forward else edges.edge_grads(m, p, c)
            assert list(edge.specs) == want
            assert list(edge.dtypes) == [edges.dtype_of(s) for s in want]
            for rows in (1, 2):
                shapes = [edges.value_shape(s, rows, m) for s in want]
                assert edge.shapes(rows) == shapes and edge.shapes(rows) is edge.shapes(rows)
                assert edge.message_bytes(rows) == messages.layout(shapes, list(edge.dtypes))[1]
    assert made.get(0, 1, True).specs  # the tiny package hands values over
