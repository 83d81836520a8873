"""
One account per conversation (:mod:`twisted_relay.affinity` and the plan's
key order in :mod:`twisted_relay.routing`): a conversation stays on its key
while it is healthy, conversations spread over the pool, a failover prefers
a key of the same account, and a move is told; all on a :class:`Clock`.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.affinity import conversation_of, key_digest, key_order
from twisted_relay.config import RelayConfig, Route, Target, Upstream
from twisted_relay.routing import Router

KEYS = tuple("sk-ant-affinity-key-%d" % (i,) for i in range(4))
# Keys 0 and 2 are account "a", 1 and 3 account "b".
ACCOUNTS = ("a", "b", "a", "b")


def router(clock, accounts=ACCOUNTS, keys=KEYS, spare=False):
    upstreams = [Upstream("pool", "https://api.anthropic.com", keys=keys, accounts=accounts)]
    targets = [Target("pool")]
    if spare:
        upstreams.append(Upstream("spare", "http://127.0.0.1:8000"))
        targets.append(Target("spare"))
    config = RelayConfig(
        listen=(), dump_dir=None, upstreams=tuple(upstreams), routes=(Route(targets=tuple(targets)),),
        breaker_failures=3, breaker_cooldown=30.0, key_rest=600.0,
    )
    return Router(config, clock)


def conversation(first: str, turns: int) -> dict:
    """A tool-use conversation ``turns`` turns long, begun with ``first``."""
    messages = [{"role": "user", "content": [{"type": "text", "text": first}]}]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": "sig%d" % (turn,)},
            {"type": "tool_use", "id": "toolu_%d" % (turn,), "name": "run", "input": {"n": turn}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_%d" % (turn,), "content": "ok"},
        ]})
    return {"model": "claude-sonnet-5-5", "max_tokens": 100, "system": "be brief", "messages": messages}


def answered(router, body, *outcomes):
    """One request: each outcome reported in turn (then 200); the attempts' key positions, and the plan."""
    plan = router.plan(body, 100)
    attempt, keys = plan.first(), []
    for outcome in list(outcomes) + [200]:
        keys.append(attempt.key_index)
        following = plan.report(attempt, outcome, retry_after=None)
        if following is None:
            return keys, plan, attempt
        attempt = following
    raise AssertionError("the plan went on after a 200")


class ConversationTests(SynchronousTestCase):
    """What names a conversation: its first user message, by value, as the client sent it."""

    def test_value_not_formatting(self):
        a = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}
        b = {"messages": [{"content": [{"cache_control": {"type": "ephemeral"}, "text": "hi", "type": "text"}], "role": "user"}]}
        self.assertEqual(conversation_of(a), conversation_of(b))

    def test_cache_control_moved_away_does_not_change_it(self):
        """
        Claude Code marks the newest message for the cache: on a conversation's
        first request that is its first user message, later it is not. Same
        conversation, same key (a string is one text block, too).
        """
        marked = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}
        later = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "ok"}]}
        plain = {"messages": [{"role": "user", "content": "hi"}]}
        self.assertEqual(conversation_of(marked), conversation_of(later))
        self.assertEqual(conversation_of(plain), conversation_of(later))

    def test_content_nested_past_recursion(self):
        """Content nested deeper than Python recurses (ujson parses 1,024 levels) names no conversation: no 500."""
        deep: list = []
        for _ in range(1000):
            deep = [deep]
        self.assertIsNone(conversation_of({"messages": [{"role": "user", "content": deep}]}))

    def test_later_turns_system_tools_model_do_not_change_it(self):
        start = conversation("fix the tests", 0)
        later = dict(conversation("fix the tests", 12), system="other", tools=[{"name": "t"}], model="claude-haiku-5-5")
        self.assertEqual(conversation_of(start), conversation_of(later))
        self.assertNotEqual(conversation_of(start), conversation_of(conversation("fix the docs", 0)))

    def test_first_user_message_skips_system_messages(self):
        inline = {"messages": [{"role": "system", "content": [{"type": "tool_addition"}]}] + conversation("x", 1)["messages"]}
        self.assertEqual(conversation_of(inline), conversation_of(conversation("x", 1)))

    def test_none(self):
        for body in (None, {}, {"messages": "x"}, {"messages": []}, {"messages": [{"role": "assistant", "content": "a"}]}):
            self.assertIsNone(conversation_of(body))

    def test_key_order_is_home_then_account_then_rest(self):
        digests = [key_digest(k) for k in KEYS]
        for n in range(20):
            order = key_order(conversation_of(conversation("c%d" % (n,), 0)), digests, ACCOUNTS)
            self.assertEqual(sorted(order), [0, 1, 2, 3])
            self.assertEqual(ACCOUNTS[order[1]], ACCOUNTS[order[0]])
            self.assertNotEqual(ACCOUNTS[order[2]], ACCOUNTS[order[0]])

    def test_removing_a_key_moves_only_its_conversations(self):
        digests = [key_digest(k) for k in KEYS]
        for n in range(50):
            c = conversation_of(conversation("c%d" % (n,), 0))
            home = key_order(c, digests)[0]
            if home != 3:
                self.assertEqual(key_order(c, digests[:3])[0], home)


class StickyKeyTests(SynchronousTestCase):
    """A conversation stays on its key while it is healthy; load spreads by conversation."""

    def setUp(self):
        self.clock = Clock()
        self.router = router(self.clock)

    def test_thirty_turns_one_key(self):
        """30 turns of one conversation over a 4-key pool: one key, no move (today: k0 k1 k2 k3 k0...)."""
        keys = set()
        for turn in range(30):
            used, plan, attempt = answered(self.router, conversation("refactor the parser", turn))
            keys.update(used)
            self.assertIsNone(plan.moved(attempt))
            self.clock.advance(5)
        self.assertEqual(len(keys), 1)

    def test_conversations_spread(self):
        """Forty conversations use every key of the pool, none more than half of them."""
        homes = [answered(self.router, conversation("task %d" % (n,), 3))[0][0] for n in range(40)]
        counts = [homes.count(k) for k in range(4)]
        self.assertTrue(all(0 < c <= 20 for c in counts), counts)

    def test_429_prefers_same_account(self):
        """A 429 on the home key: the next attempt is the other key of its account; the move is told."""
        for n in range(8):
            used, plan, attempt = answered(self.router, conversation("job %d" % (n,), 2), 429)
            self.assertEqual(len(used), 2)
            self.assertEqual(ACCOUNTS[used[1]], ACCOUNTS[used[0]])
            self.assertEqual(plan.moved(attempt), ("pool key #%d" % (used[0] + 1,), False))
            self.clock.advance(31)  # the rate-limited key is back

    def test_both_account_keys_limited_then_other_account(self):
        used, plan, attempt = answered(self.router, conversation("job", 2), 429, 429)
        self.assertEqual(len(set(ACCOUNTS[k] for k in used)), 2)
        self.assertEqual(plan.moved(attempt)[1], True)

    def test_resting_home_then_back(self):
        """While its key rests the conversation goes to its account's other key; back home once rested."""
        body = conversation("long session", 4)
        home = answered(self.router, body, 429)[0][0]
        used, plan, attempt = answered(self.router, body)
        self.assertEqual(ACCOUNTS[used[0]], ACCOUNTS[home])
        self.assertNotEqual(used[0], home)
        self.clock.advance(31)
        self.assertEqual(answered(self.router, body)[0], [home])

    def test_no_accounts_named_is_a_move_across(self):
        r = router(self.clock, accounts=())
        used, plan, attempt = answered(r, conversation("job", 1), 429)
        self.assertEqual(plan.moved(attempt)[1], True)

    def test_upstream_failover_is_a_move_across(self):
        r = router(self.clock, keys=KEYS[:1], accounts=(), spare=True)
        plan = r.plan(conversation("job", 1), 100)
        following = plan.report(plan.first(), 529)
        self.assertEqual(following.upstream.name, "spare")
        self.assertEqual(plan.moved(following), ("pool key #1", True))

    def test_pinned_tries_home_only(self):
        """A pinned plan (an upstream's thread) never leaves its home key: its 429 is the client's."""
        body = conversation("threaded", 2)
        home = answered(self.router, body)[0][0]
        plan = self.router.plan(body, 100)
        plan.pin()
        first = plan.first()
        self.assertEqual(first.key_index, home)
        self.assertIsNone(plan.report(first, 429))
        # Pinned, a resting home key is still the one tried.
        plan = self.router.plan(body, 100)
        plan.pin()
        self.assertEqual(plan.first().key_index, home)


class RecentConversationsTests(SynchronousTestCase):
    def test_bounded_least_recently_used_first(self):
        from twisted_relay.affinity import RecentConversations

        recent = RecentConversations(size=2)
        recent.add("a")
        recent.add("b")
        self.assertIn("a", recent)  # used: "b" is now the oldest
        recent.add("c")
        self.assertEqual((("a" in recent), ("b" in recent), ("c" in recent), len(recent)), (True, False, True, 2))

    def test_kept_over_a_reload(self):
        r = router(Clock())
        r.dropping.add("x")
        self.assertIn("x", r.reloaded(r.config).dropping)
