"""Tool-call ids as OpenAI-protocol upstreams take them (:mod:`twisted_relay.openai.ids`)."""

from __future__ import annotations

import re

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.openai.ids import fit_id, fit_ids


def history(*ids: str) -> dict:
    messages = [{"role": "user", "content": "go"}]
    for value in ids:
        messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": value, "name": "t", "input": {}}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": value, "content": "ok"}]})
    return {"model": "m", "messages": messages}


class FitTests(SynchronousTestCase):
    def test_mistral_nine(self):
        """Every id Mistral gets is nine letters or digits, a call paired with its result (openclaw #57672)."""
        ids = ("toolu_01AbCdEf", "toolu_01AbCdEf-2", "functions.Bash:3", "abcDEF123", "call_" + "x" * 60)
        body = fit_ids(history(*ids), "mistral")
        sent = []
        for message in body["messages"][1:]:
            block = message["content"][0]
            sent.append(block.get("id") or block.get("tool_use_id"))
        for value in sent:
            self.assertRegex(value, r"^[A-Za-z0-9]{9}$")
        self.assertEqual(sent[0::2], sent[1::2])
        self.assertEqual(len(set(sent[0::2])), len(ids))
        # Its own ids come back to it unchanged.
        self.assertEqual(fit_id("abcDEF123", "mistral"), "abcDEF123")

    def test_lengths(self):
        long = "toolu_" + "y" * 100
        self.assertLessEqual(len(fit_id(long, "responses")), 64)
        self.assertLessEqual(len(fit_id(long, "chat")), 40)
        self.assertNotEqual(fit_id(long, "chat"), fit_id(long + "z", "chat"))
        self.assertEqual(fit_id("call_abc", "responses"), "call_abc")

    def test_untouched_body_is_the_same(self):
        body = history("call_1", "call_2")
        self.assertIs(fit_ids(body, "responses"), body)

    def test_distinct_stay_distinct(self):
        """Many distinct ids keep distinct digests (no pairing of two calls by accident)."""
        digests = {fit_id("toolu_%06d" % (n,), "mistral") for n in range(20000)}
        self.assertEqual(len(digests), 20000)
        self.assertTrue(all(re.fullmatch(r"[A-Za-z0-9]{9}", d) for d in digests))
