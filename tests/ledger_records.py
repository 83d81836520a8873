"""
Usage records for the ledger's tests, as metering makes them
(:class:`~twisted_relay.usage.UsageRecord`).
"""

from __future__ import annotations

from decimal import Decimal

from twisted_relay.usage import TOKEN_KINDS, UsageRecord

#: 2026-12-01T00:00:00Z.
DECEMBER_FIRST = 1796083200.0


def usage_record(number: int, **changes) -> UsageRecord:
    """
    The ``number``-th record of a known set: request ``rly_test_NUMBER``, an
    hour after the previous one from :data:`DECEMBER_FIRST`, ``number``
    tokens of each kind and ``number`` × $0.000123 (changes override).
    """
    values = dict(
        at=DECEMBER_FIRST + number * 3600.0,
        request_id="rly_test_%06d" % (number,),
        key_name="alice",
        key_group="team-a",
        session_id="session-1",
        agent_id=None,
        parent_agent_id=None,
        upstream="default",
        model="claude-sonnet-4-5",
        status=200,
        stream=True,
        partial=False,
        tokens={kind: number for kind in TOKEN_KINDS},
        cost=Decimal("0.000123") * number,
        usage='{"input_tokens": %d}' % (number,),
    )
    values.update(changes)
    return UsageRecord(**values)
