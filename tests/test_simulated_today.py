# -*- test-case-name: tests.test_simulated_today -*-
"""
Tests for the simulated upstream's today's API (:mod:`twisted_relay.simulated.today`
and :mod:`twisted_relay.simulated.thinking`): model families and their thinking
rules, thinking bound to its prefix, model and account, both API versions,
and the answer's today shape.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.test_simulated import TOOLS, _answer_results, parse_sse
from tests.test_simulated import _Upstream as _AnyUpstream
from twisted_relay.simulated.thinking import BINDING_BETA, prefix_mismatch_message
from twisted_relay.simulated.today import FAMILIES, family_of

SONNET = "claude-sonnet-5-5"


def _Upstream(**options: Any) -> _AnyUpstream:
    """A strict simulated upstream whose model does not reuse ids (these tests are
    about thinking, not ids)."""
    options.setdefault("reuse_every", 0)
    return _AnyUpstream(**options)

BETA = {"anthropic-beta": BINDING_BETA}


def _body(messages: list, model: str = SONNET, **extra: Any) -> dict:
    body = {"model": model, "max_tokens": 1024, "messages": messages, "tools": TOOLS,
            "system": [{"type": "text", "text": "You are a careful agent."}]}
    body.update(extra)
    return body


def _assistant(answer: dict) -> dict:
    return {"role": "assistant", "content": answer["content"]}


def converse(up: _Upstream, turns: int, model: str = SONNET, headers: dict | None = None,
             **extra: Any) -> tuple[list, dict]:
    """Run ``turns`` turns as an append-only client; the history and the last body."""
    messages: list = [{"role": "user", "content": "Fais le tour des outils."}]
    body = _body(messages, model, **extra)
    for _ in range(turns):
        body = _body(messages, model, **extra)
        response, answer = up.post(body, headers=headers)
        if response.code != 200:
            raise AssertionError(answer)
        messages = messages + [_assistant(answer), _answer_results(answer)]
    return messages, _body(messages, model, **extra)


def _first_thinking(messages: list) -> tuple[int, int]:
    for n, message in enumerate(messages):
        if isinstance(message["content"], list):
            for m, block in enumerate(message["content"]):
                if block["type"] == "thinking":
                    return n, m
    raise AssertionError("no thinking")


class FamilyTests(SynchronousTestCase):
    """Today's model ids and their thinking rules."""

    def test_family_of(self) -> None:
        """Plain and dated ids of today's models have a family; year-old ids have none."""
        self.assertEqual(family_of("claude-sonnet-5-5").name, "sonnet-5.5")
        self.assertEqual(family_of("claude-opus-5-5-20261101").name, "opus-5.5")
        self.assertIsNone(family_of("claude-sonnet-4-5-20250929"))
        self.assertIsNone(family_of(None))
        self.assertEqual(family_of("claude-opus-4-6").name, "opus-4.6")
        self.assertEqual(len(FAMILIES), 9)

    def test_opus_4_6_thinks_when_asked(self) -> None:
        """Opus 4.6 (the clouds' InvokeModel and rawPredict serve it) thinks
        adaptively or manually when the request asks, summarized by default,
        and not at all when the request has no ``thinking``."""
        up = _Upstream()
        messages = [{"role": "user", "content": "hi"}]
        _, plain = up.post(_body(messages, "claude-opus-4-6"))
        self.assertNotEqual(plain["content"][0]["type"], "thinking")
        for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2048}):
            _, answer = up.post(_body(messages, "claude-opus-4-6", thinking=thinking))
            self.assertEqual(answer["content"][0]["type"], "thinking", thinking)
            self.assertTrue(answer["content"][0]["thinking"])
            self.assertGreater(answer["usage"]["output_tokens_details"]["thinking_tokens"], 0)
        response, error = up.post(_body(messages, "claude-opus-4-6", thinking={"type": "enabled"}))
        self.assertEqual((response.code, error["error"]["message"]),
                         (400, "thinking.enabled.budget_tokens: Field required"))
        messages, body = converse(up, 4, "claude-opus-4-6", thinking={"type": "adaptive"})
        response, _ = up.post(body)
        self.assertEqual(response.code, 200)

    def test_adaptive_by_default(self) -> None:
        """Without ``thinking``, today's models answer with a signed thinking block
        (display omitted: empty text), and today's usage fields."""
        _, answer = _Upstream().post(_body([{"role": "user", "content": "hi"}]))
        thinking = answer["content"][0]
        self.assertEqual(thinking["type"], "thinking")
        self.assertEqual(thinking["thinking"], "")
        self.assertTrue(thinking["signature"])
        usage = answer["usage"]
        self.assertEqual(usage["cache_creation"], {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0})
        self.assertEqual(usage["server_tool_use"], {"web_search_requests": 0, "web_fetch_requests": 0})
        self.assertGreater(usage["output_tokens_details"]["thinking_tokens"], 0)
        self.assertEqual(usage["service_tier"], "standard")
        self.assertIsNone(answer["stop_details"])
        self.assertNotIn("input_transformations", answer)

    def test_summarized_display(self) -> None:
        """``display: summarized`` returns the thinking text."""
        body = _body([{"role": "user", "content": "hi"}], thinking={"type": "adaptive", "display": "summarized"})
        _, answer = _Upstream().post(body)
        self.assertTrue(answer["content"][0]["thinking"])

    def test_refused_thinking_types(self) -> None:
        """``enabled``/``disabled`` are 400 where the model does not take them."""
        up = _Upstream()
        for model, kind in [("claude-sonnet-5-5", "disabled"), ("claude-sonnet-5-5", "enabled"),
                            ("claude-opus-5-5", "disabled"), ("claude-fable-5-1", "enabled"),
                            ("claude-haiku-5-5", "enabled"), ("claude-opus-5-5", "between_tools")]:
            thinking = {"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind}
            response, error = up.post(_body([{"role": "user", "content": "hi"}], model, thinking=thinking))
            self.assertEqual(response.code, 400, (model, kind))
            self.assertEqual(error["error"]["type"], "invalid_request_error")
            self.assertTrue(error["error"]["message"].startswith(
                f'"thinking.type.{kind}" is not supported for this model. Use "thinking.type.adaptive" and '
                '"output_config.effort"'), error)

    def test_accepted_thinking_types(self) -> None:
        """Sonnet 5.5 takes ``between_tools`` (no thinking up front, thinking in a tool
        loop); Haiku 5.5 takes ``disabled`` at its default effort but not at ``max``."""
        up = _Upstream()
        first = [{"role": "user", "content": "hi"}]
        response, answer = up.post(_body(first, thinking={"type": "between_tools"}))
        self.assertEqual(response.code, 200)
        self.assertNotEqual(answer["content"][0]["type"], "thinking")
        loop = first + [_assistant(answer), _answer_results(answer)]
        _, answer = up.post(_body(loop, thinking={"type": "between_tools"}))
        self.assertEqual(answer["content"][0]["type"], "thinking")
        response, answer = up.post(_body(first, "claude-haiku-5-5", thinking={"type": "disabled"}))
        self.assertEqual(response.code, 200)
        self.assertNotEqual(answer["content"][0]["type"], "thinking")
        response, _ = up.post(_body(first, "claude-haiku-5-5", thinking={"type": "disabled"},
                                    output_config={"effort": "max"}))
        self.assertEqual(response.code, 400)
        response, error = up.post(_body(first, thinking={"type": "between_tools", "display": "summarized"}))
        self.assertEqual(error["error"]["message"], "thinking.between_tools.display: Extra inputs are not permitted")

    def test_forced_tool_choice(self) -> None:
        """Forced tool choice is 400 on Sonnet 5.5; Haiku 5.5 takes it and does not think."""
        up = _Upstream()
        first = [{"role": "user", "content": "hi"}]
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
            response, error = up.post(_body(first, tool_choice=choice))
            self.assertEqual(response.code, 400)
            self.assertEqual(error["error"]["message"],
                             'tool_choice: type "tool" and "any" are not supported for this model.')
        response, answer = up.post(_body(first, "claude-haiku-5-5", tool_choice={"type": "any"}))
        self.assertEqual(response.code, 200)
        self.assertEqual([block["type"] for block in answer["content"]], ["text", "tool_use"])
        response, _ = up.post(_body(first, tool_choice={"type": "auto"}))
        self.assertEqual(response.code, 200)

    def test_year_old_models_unchanged(self) -> None:
        """A year-old model id keeps the year-old rules: no thinking unless asked,
        forced tool choice and ``enabled`` accepted."""
        up = _Upstream()
        first = [{"role": "user", "content": "hi"}]
        old = "claude-sonnet-4-5-20250929"
        response, answer = up.post(_body(first, old, tool_choice={"type": "any"}))
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["content"][0]["type"], "text")
        response, _ = up.post(_body(first, old, thinking={"type": "enabled", "budget_tokens": 1024}))
        self.assertEqual(response.code, 200)


class BindingTests(SynchronousTestCase):
    """Thinking bound to its prefix (by value), its model and its account."""

    def test_append_only_session_survives(self) -> None:
        """Ten turns sending everything back unchanged: every block accepted, none dropped."""
        up = _Upstream()
        messages, body = converse(up, 10, headers=BETA)
        response, answer = up.post(body, headers=BETA)
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["input_transformations"], [])
        self.assertEqual(sum(1 for m in messages for b in m["content"] if isinstance(b, dict)
                             and b["type"] == "thinking"), 10)

    def test_models_taking_turns(self) -> None:
        """
        A conversation switching models each turn: a block the model cannot
        read is dropped silently (with the beta: listed as a model mismatch),
        and the blocks after it are still read, as the API does; no 400.
        """
        up = _Upstream()
        messages: list = [{"role": "user", "content": "Fais le tour des outils."}]
        models = ("claude-sonnet-5-5", "claude-opus-5-5") * 3
        for model in models:
            response, answer = up.post(_body(messages, model), headers=BETA)
            self.assertEqual(response.code, 200, answer)
            reasons = {entry["reason"] for entry in answer["input_transformations"]}
            self.assertLessEqual(reasons, {"model_binding_mismatch"})
            messages = messages + [_assistant(answer), _answer_results(answer)]

    def test_value_not_bytes(self) -> None:
        """Key order, string vs one text block, and cache_control do not change the prefix."""
        up = _Upstream()
        messages, body = converse(up, 3)
        body = json.loads(json.dumps(body, sort_keys=True))
        body["system"] = "You are a careful agent."
        body["messages"][0]["content"] = [{"type": "text", "text": "Fais le tour des outils.",
                                           "cache_control": {"type": "ephemeral"}}]
        body["tools"][-1] = dict(reversed(list(body["tools"][-1].items())), cache_control={"type": "ephemeral"})
        response, answer = up.post(body)
        self.assertEqual(response.code, 200, answer)

    def test_edited_prefix_is_the_exact_400(self) -> None:
        """An edited earlier message: the API's 400 naming the first bound block, with
        the beta sentence when the beta is not sent."""
        up = _Upstream()
        messages, body = converse(up, 3)
        body["messages"][0]["content"] = "Fais le tour des outils, vite."
        n, m = _first_thinking(body["messages"])
        response, error = up.post(body)
        self.assertEqual(response.code, 400)
        self.assertEqual(error["error"]["type"], "invalid_request_error")
        self.assertEqual(error["error"]["message"], prefix_mismatch_message(n, m, beta=False))
        self.assertTrue(error["error"]["message"].endswith(
            "That setting requires the `thinking-binding-controls-2026-08-01` value in the `anthropic-beta` header."))
        response, error = up.post(body, headers=BETA)
        self.assertEqual(error["error"]["message"], prefix_mismatch_message(n, m, beta=True))
        response, error = up.post(dict(body, tools=TOOLS[:1]), headers=BETA)
        self.assertEqual(response.code, 400, "changed tools are an edit")

    def test_drop_block(self) -> None:
        """``drop_block`` with the beta drops the invalid blocks and lists them; without the
        beta the field itself is refused."""
        up = _Upstream()
        messages, body = converse(up, 3)
        body["messages"][2]["content"][0]["content"] = "shortened"
        body["thinking"] = {"type": "adaptive", "block_binding": {"prefix_mismatch_behavior": "drop_block"}}
        response, error = up.post(body)
        self.assertEqual(response.code, 400)
        self.assertEqual(error["error"]["message"], "thinking.adaptive.block_binding: Extra inputs are not permitted")
        response, answer = up.post(body, headers=BETA)
        self.assertEqual(response.code, 200, answer)
        self.assertEqual(answer["input_transformations"], [
            {"type": "thinking_dropped", "path": "messages.3.content.0", "reason": "prefix_binding_mismatch"},
            {"type": "thinking_dropped", "path": "messages.5.content.0", "reason": "prefix_binding_mismatch"},
        ])

    def test_thinking_removed_from_the_middle(self) -> None:
        """Dropping a leading or trailing run of thinking is fine; from the middle it is an
        edit, and so is putting back a removed block."""
        up = _Upstream()
        messages, body = converse(up, 4)
        positions = [n for n, message in enumerate(messages) if message["role"] == "assistant"]

        def without(*dropped: int) -> dict:
            sent = copy.deepcopy(body)
            for n in dropped:
                sent["messages"][n]["content"] = sent["messages"][n]["content"][1:]
            return sent

        self.assertEqual(up.post(without(positions[0]))[0].code, 200, "leading run")
        self.assertEqual(up.post(without(positions[-1]))[0].code, 200, "trailing run")
        self.assertEqual(up.post(without(*positions))[0].code, 200, "all")
        response, error = up.post(without(positions[1]))
        self.assertEqual(response.code, 400)
        self.assertEqual(error["error"]["message"], prefix_mismatch_message(positions[2], 0, beta=False))
        # Drop the first block, go on a turn, then put it back.
        sent = without(positions[0])
        _, answer = up.post(sent)
        sent["messages"] += [_assistant(answer), _answer_results(answer)]
        self.assertEqual(up.post(sent)[0].code, 200)
        sent["messages"][positions[0]] = body["messages"][positions[0]]
        self.assertEqual(up.post(sent)[0].code, 400, "a removed block put back")

    def test_forged_signature(self) -> None:
        """A signature this upstream did not make, or an edited thinking text, is the short
        400 that no setting handles."""
        up = _Upstream()
        messages, body = converse(up, 2, thinking={"type": "adaptive", "display": "summarized"})
        n, m = _first_thinking(body["messages"])
        body["messages"][n]["content"][m]["thinking"] += " (edited)"
        body["thinking"] = {"type": "adaptive", "block_binding": {"prefix_mismatch_behavior": "drop_block"}}
        response, error = up.post(body, headers=BETA)
        self.assertEqual(response.code, 400)
        self.assertEqual(error["error"]["message"], f"messages.{n}.content.{m}: Invalid `signature` in `thinking` block")
        other = _Upstream(thinking_secret="another")
        _, body = converse(up, 2)
        self.assertEqual(other.post(body)[0].code, 400)

    def test_restart_and_instances_agree(self) -> None:
        """Signatures are checked without state: another instance with the same secret
        accepts them."""
        messages, body = converse(_Upstream(thinking_secret="s"), 3)
        self.assertEqual(_Upstream(thinking_secret="s").post(body)[0].code, 200)

    def test_model_binding_drops_silently(self) -> None:
        """Sonnet 5.5 cannot read Opus 5.5's thinking: dropped with a 200, listed only with
        the beta; Opus 5.5 reads Sonnet 5.5's."""
        up = _Upstream()
        _, body = converse(up, 2, model="claude-opus-5-5")
        response, answer = up.post(dict(body, model=SONNET))
        self.assertEqual(response.code, 200)
        self.assertNotIn("input_transformations", answer)
        _, answer = up.post(dict(body, model=SONNET), headers=BETA)
        self.assertEqual([entry["reason"] for entry in answer["input_transformations"]],
                         ["model_binding_mismatch"] * 2)
        _, body = converse(up, 2)
        _, answer = up.post(dict(body, model="claude-opus-5-5"), headers=BETA)
        self.assertEqual(answer["input_transformations"], [])

    def test_account_binding(self) -> None:
        """Sonnet 5.5 thinking replayed under another account's key is dropped silently
        (``organization_binding_mismatch`` with the beta); a key of the same account, or
        the same key as a Bearer token, reads it."""
        up = _Upstream(accounts={"k0": "acme", "k1": "acme", "k2": "other"})
        _, body = converse(up, 2, headers={"x-api-key": "k0"})
        response, answer = up.post(body, headers={"x-api-key": "k2", **BETA})
        self.assertEqual(response.code, 200)
        self.assertEqual([entry["reason"] for entry in answer["input_transformations"]],
                         ["organization_binding_mismatch"] * 2)
        for headers in ({"x-api-key": "k1"}, {"authorization": "Bearer k0"}):
            _, answer = up.post(body, headers={**headers, **BETA})
            self.assertEqual(answer["input_transformations"], [], headers)
        _, body = converse(up, 2, model="claude-opus-5-5", headers={"x-api-key": "k0"})
        _, answer = up.post(body, headers={"x-api-key": "k2", **BETA})
        self.assertEqual(answer["input_transformations"], [], "Opus 5.5 thinking is not account-bound")

    def test_older_account(self) -> None:
        """An account created before 2026-08-31 is not refused: with the beta, the
        mismatch is reported as allowed."""
        up = _Upstream(binding_default="allow")
        _, body = converse(up, 2)
        body["messages"][0]["content"] = "edited"
        self.assertEqual(up.post(body)[0].code, 200)
        _, answer = up.post(body, headers=BETA)
        self.assertEqual([entry["type"] for entry in answer["input_transformations"]],
                         ["thinking_mismatch_allowed"] * 2)

    def test_count_tokens_checks_too(self) -> None:
        """count_tokens runs the same check."""
        up = _Upstream()
        _, body = converse(up, 2)
        body["messages"][0]["content"] = "edited"
        del body["max_tokens"]
        response, _ = up.post(body, path="/v1/messages/count_tokens")
        self.assertEqual(response.code, 400)

    def test_year_old_api(self) -> None:
        """``api="2025"``: no thinking by default on any model, no binding."""
        up = _Upstream(api="2025")
        _, answer = up.post(_body([{"role": "user", "content": "hi"}]))
        self.assertEqual(answer["content"][0]["type"], "text")
        self.assertNotIn("stop_details", answer)
        self.assertEqual(up.post(_body([{"role": "user", "content": "hi"}], tool_choice={"type": "any"}))[0].code, 200)


class VersionTests(SynchronousTestCase):
    """``anthropic-version: 2026-10-21`` and ``2023-06-01``."""

    def _post(self, body: dict, version: str) -> tuple[Any, Any]:
        return _Upstream().post(body, headers={"anthropic-version": version})

    def test_sampling_parameters(self) -> None:
        """temperature, top_p and top_k are refused even at defaults under 2026-10-21."""
        for name, value in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 40)):
            body = _body([{"role": "user", "content": "hi"}], "claude-sonnet-4-5", **{name: value})
            response, error = self._post(body, "2026-10-21")
            self.assertEqual(response.code, 400)
            self.assertEqual(error["error"]["message"], f"{name}: Extra inputs are not permitted")
            self.assertEqual(self._post(body, "2023-06-01")[0].code, 200)

    def test_documents_and_citations(self) -> None:
        """A document in an assistant turn and citations on a user text block are refused
        under 2026-10-21 only."""
        document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
        cited = {"type": "text", "text": "as said", "citations": [{"type": "char_location", "cited_text": "x",
                                                                   "document_index": 0, "start_char_index": 0,
                                                                   "end_char_index": 1}]}
        for messages, path in (
            ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [document]},
              {"role": "user", "content": "and?"}], "messages.1.content.0"),
            ([{"role": "user", "content": [cited]}], "messages.0.content.0.citations"),
        ):
            body = _body(messages, "claude-sonnet-4-5")
            response, error = self._post(body, "2026-10-21")
            self.assertEqual(response.code, 400)
            self.assertTrue(error["error"]["message"].startswith(path + ":"), error)
            self.assertEqual(self._post(body, "2023-06-01")[0].code, 200)


class AnswerTests(SynchronousTestCase):
    """Today's answer shape."""

    def test_fresh_ids(self) -> None:
        """Two conversations that start alike get different msg_ ids."""
        up = _Upstream()
        body = _body([{"role": "user", "content": "hi"}])
        ids = {up.post(body)[1]["id"] for _ in range(5)}
        self.assertEqual(len(ids), 5)

    def test_stream_carries_transformations_on_message_start(self) -> None:
        """Streaming: input_transformations arrive on message_start; an omitted thinking
        block carries only a signature_delta."""
        up = _Upstream()
        _, body = converse(up, 2, model="claude-opus-5-5")
        response, data = up.post(dict(body, model=SONNET, stream=True), headers=BETA)
        events = parse_sse(data)
        start = events[0][1]["message"]
        self.assertEqual(len(start["input_transformations"]), 2)
        deltas = [payload["delta"]["type"] for name, payload in events
                  if name == "content_block_delta" and payload["index"] == 0]
        self.assertEqual(deltas, ["signature_delta"])

    def test_mid_stream_error(self) -> None:
        """stream_errors=1: the stream ends after its first block with an error event."""
        up = _Upstream(stream_errors=1.0)
        response, data = up.post(_body([{"role": "user", "content": "hi"}], stream=True))
        events = parse_sse(data)
        self.assertEqual(events[-1][0], "error")
        self.assertEqual(events[-1][1]["error"]["type"], "overloaded_error")
        self.assertEqual(events[-1][1]["request_id"], response.headers.getRawHeaders("request-id")[0])
        self.assertNotIn("message_stop", [name for name, _ in events])


class RareAnswerTests(SynchronousTestCase):
    """Refusals and compactions, seeded and off by default."""

    def test_off_by_default(self) -> None:
        """A default upstream never refuses nor compacts."""
        up = _Upstream()
        reasons = {up.post(_body([{"role": "user", "content": f"question {i}"}]))[1]["stop_reason"]
                   for i in range(12)}
        self.assertEqual(reasons, {"tool_use"})

    def test_refusal(self) -> None:
        """refusals=1: every answer is a refusal with stop_details, and the session goes on."""
        up = _Upstream(refusals=1.0)
        _, answer = up.post(_body([{"role": "user", "content": "hi"}]))
        self.assertEqual(answer["stop_reason"], "refusal")
        self.assertEqual(answer["stop_details"]["type"], "refusal")
        self.assertIn(answer["stop_details"]["category"], ("cyber", "general_harms"))
        messages = [{"role": "user", "content": "hi"}, _assistant(answer), {"role": "user", "content": "Go on."}]
        self.assertEqual(up.post(_body(messages))[0].code, 200)

    def test_compaction(self) -> None:
        """compactions=1: a compaction block alone, sent back by value with the rest."""
        up = _Upstream(compactions=1.0)
        _, answer = up.post(_body([{"role": "user", "content": "hi"}]))
        self.assertEqual(answer["stop_reason"], "compaction")
        self.assertEqual([block["type"] for block in answer["content"]], ["compaction"])
        self.assertTrue(answer["content"][0]["encrypted_content"])

    def test_seeded_share(self) -> None:
        """A share in between: some answers, the same ones on every instance."""
        def kinds() -> list:
            up = _Upstream(refusals=0.5, seed=1)
            return [up.post(_body([{"role": "user", "content": f"question {i}"}]))[1]["stop_reason"]
                    for i in range(12)]

        first = kinds()
        self.assertEqual(first, kinds())
        self.assertIn("refusal", first)
        self.assertTrue(set(first) - {"refusal"})


class CommandLineTests(SynchronousTestCase):
    """``twisted-relay-simulated``'s options for today's API."""

    def test_defaults_and_values(self) -> None:
        """Today's API by default; --api 2025 and the binding, account and share options."""
        from twisted_relay.simulated.cli import parse_args, upstream_from

        default = upstream_from(parse_args([]))
        self.assertEqual((default.api, default.stream_errors), ("2026-12", 0.0))
        self.assertEqual(default.today.binding_default, "error")
        chosen = upstream_from(parse_args([
            "--account", "k0=acme", "--account", "k1=acme", "--binding-default", "allow",
            "--stream-errors", "0.25", "--refusals", "0.1", "--compactions", "0.2",
        ]))
        self.assertEqual(chosen.today.accounts, {"k0": "acme", "k1": "acme"})
        self.assertEqual(chosen.today.binding_default, "allow")
        self.assertEqual((chosen.stream_errors, chosen.rare), (0.25, (("refusal", 0.1), ("compaction", 0.2))))
        self.assertIsNone(upstream_from(parse_args(["--api", "2025"])).today)

    def test_bad_values(self) -> None:
        """Bad values are usage errors (exit status 2)."""
        import contextlib
        import io

        from twisted_relay.simulated.cli import parse_args

        for argv in (["--api", "2024"], ["--account", "nokey"], ["--stream-errors", "2"], ["--refusals", "x"]):
            with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as raised:
                parse_args(argv)
            self.assertEqual(raised.exception.code, 2, argv)


class FallbackTests(SynchronousTestCase):
    """Server-side fallback: a refused turn served by the next model."""

    def test_fallback_block(self) -> None:
        """With ``fallbacks`` and its beta, a refusal becomes the fallback model's answer after
        a ``fallback`` block, with a ``fallback_message`` iteration; sent back in place, the
        session goes on.  Without the beta the field is refused."""
        up = _Upstream(refusals=1.0)
        first = [{"role": "user", "content": "hi"}]
        response, error = up.post(_body(first, fallbacks="default"))
        self.assertEqual(error["error"]["message"], "fallbacks: Extra inputs are not permitted")
        headers = {"anthropic-beta": "server-side-fallback-2026-07-01"}
        response, answer = up.post(_body(first, fallbacks=[{"model": "claude-opus-5"}]), headers=headers)
        self.assertEqual(response.code, 200)
        self.assertEqual(answer["model"], "claude-opus-5")
        marker = answer["content"][0]
        self.assertEqual((marker["type"], marker["from"], marker["to"]),
                         ("fallback", {"model": SONNET}, {"model": "claude-opus-5"}))
        self.assertEqual([it["type"] for it in answer["usage"]["iterations"]], ["message", "fallback_message"])
        self.assertEqual(answer["stop_reason"], "tool_use")
        messages = first + [_assistant(answer), _answer_results(answer)]
        self.assertEqual(up.post(_body(messages, fallbacks="default"), headers=headers)[0].code, 200)


class ToolLoopRuleTests(SynchronousTestCase):
    """The "final assistant turn of a tool loop starts with thinking" rule (year-old
    models with a thinking secret): today only for manual ``enabled`` thinking."""

    def _loop(self, thinking: dict, **options: Any) -> int:
        up = _Upstream(mode="lenient", thinking_secret="s", **options)
        old = "claude-sonnet-4-5"
        first = [{"role": "user", "content": "hi"}]
        _, answer = up.post(_body(first, old, thinking=thinking))
        content = [block for block in answer["content"] if block["type"] != "thinking"]
        messages = first + [{"role": "assistant", "content": content}, _answer_results(answer)]
        return up.post(_body(messages, old, thinking=thinking))[0].code

    def test_manual_only(self) -> None:
        """Thinking left out of the loop: 400 with ``enabled``; accepted with ``adaptive``
        under today's API, refused under the year-old one."""
        self.assertEqual(self._loop({"type": "enabled", "budget_tokens": 1024}), 400)
        self.assertEqual(self._loop({"type": "adaptive"}), 200)
        self.assertEqual(self._loop({"type": "adaptive"}, api="2025"), 400)
