"""The batch search every benchmark and the automatic placement lean on."""

import pytest

from flexh2o.planning.placement import largest


@pytest.mark.parametrize("edge,limit", [(0, 10), (1, 10), (37, 100), (64, 64), (64, 100), (100, 100)])
def test_largest_finds_the_last_admitted_batch(edge, limit):
    asked = []

    def ok(b):
        asked.append(b)
        return b <= edge

    assert largest(ok, limit) == min(edge, limit)
    assert max(asked) <= limit and len(asked) <= 2 * limit.bit_length() + 1
