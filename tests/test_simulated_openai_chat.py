"""
The simulated Chat Completions upstream (``twisted_relay.simulated.openai_chat``):
first with the official ``openai`` SDK over 127.0.0.1 (its types and its stream
parser take every answer of every dialect, extras included), then each
dialect's rules and refusals in memory (StubTreq, a Clock).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from treq.testing import StubTreq
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import ResponseFailed
from twisted.web.server import Site

from tests.test_simulated import _result
from twisted_relay.simulated.openai_chat import SimulatedOpenAIChat
from twisted_relay.simulated.openai_chat_dialects import DIALECTS, GEMINI_CORRUPTED
from twisted_relay.simulated.openai_chat_reasoning import DEEPSEEK_MISSING
from twisted_relay.simulated.resource import SimulatedUpstream

KEY = "sk-chat-simulated"
OTHER_KEY = "sk-chat-other-account"
BASE = "http://chat.test"

MODELS = {
    "openai": "gpt-4.1",
    "deepseek": "deepseek-v4-pro",
    "kimi": "kimi-k2.6",
    "gemini": "gemini-3-pro-preview",
    "groq": "openai/gpt-oss-120b",
    "mistral": "mistral-large-latest",
    "openrouter": "google/gemini-3-pro-preview",
}
#: The shape of the ids each dialect makes.
ID_SHAPES = {
    "openai": r"call_[0-9A-Za-z]{22}",
    "deepseek": r"call_\d\d_[0-9A-Za-z]{22}",
    "kimi": r"functions\.[A-Za-z_]+:\d+",
    "gemini": r"function-call-\d{19}",
    "groq": r"call_[0-9A-Za-z]{22}",
    "mistral": r"[0-9A-Za-z]{9}",
    "openrouter": r"call_[0-9A-Za-z]{22}",
}
#: What each dialect needs in the body to show its reasoning.
REASONING_ON = {"groq": {"reasoning_format": "parsed"}}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather at a place.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "Bash", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]
#: A system prompt long enough for the prompt cache (512 tokens and more).
LONG_SYSTEM = "You are a careful assistant. " * 120


def _first_messages(system: str = "Be brief.") -> list:
    return [{"role": "system", "content": system}, {"role": "user", "content": "Quel temps fait-il à Genève ?"}]


def _replay(message: dict) -> list:
    """The assistant message as a client sends it back, and a result for each call."""
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "22°C, sunny"}
               for call in message.get("tool_calls") or ()]
    return [message, *results] if results else [message, {"role": "user", "content": "Continue."}]


def _sdk_message(message: Any) -> dict:
    """An SDK message as a plain dict to send back (extras kept; left out: the SDK's own
    parsed fields, and the ``index`` its stream accumulator leaves on tool calls)."""
    sent = message.model_dump(exclude_none=True, exclude={"parsed"})
    for call in sent.get("tool_calls") or ():
        call["function"].pop("parsed_arguments", None)
        call.pop("index", None)
    return sent


# -- with the official SDK, over 127.0.0.1 ------------------------------------------------


class SDKTests(TestCase):
    """The ``openai`` SDK against every dialect on 127.0.0.1."""

    def serve(self, dialect: str, **options: Any) -> tuple[SimulatedOpenAIChat, str]:
        upstream_options = options.pop("upstream_options", {})
        upstream = SimulatedUpstream(mode="lenient", id_style="kimi" if dialect == "kimi" else "toolu",
                                     reactor=reactor, **upstream_options)
        sim = SimulatedOpenAIChat(dialect, upstream, keys=[KEY], **options)
        port = reactor.listenTCP(0, Site(sim.resource()), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return sim, f"http://127.0.0.1:{port.getHost().port}/v1"

    def client(self, url: str):
        import openai

        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)
        self.addCleanup(client.close)
        return client

    async def test_tool_loop_every_dialect(self) -> None:
        """Each dialect runs a tool loop through ``chat.completions.create`` and the SDK's
        streaming helper (every chunk parsed and accumulated, ``stream_options`` asking for
        usage): the streamed answer is the answer, ids of the dialect's shape, a copied id
        among them, the reasoning sent back as the SDK gave it accepted as each turn's own."""
        for dialect in DIALECTS:
            sim, url = self.serve(dialect)
            client = self.client(url)

            def session() -> list:
                messages = _first_messages()
                seen = []
                for turn in range(6):
                    kwargs = dict(model=MODELS[dialect], messages=messages, tools=TOOLS,
                                  extra_body=REASONING_ON.get(dialect))
                    answer = client.chat.completions.create(**kwargs)
                    if turn % 2:
                        with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as s:
                            chunks = [event.chunk for event in s if event.type == "chunk"]
                            streamed = s.get_final_completion()
                        seen.append((answer, streamed, chunks))
                    else:
                        seen.append((answer, None, []))
                    sent = _sdk_message(answer.choices[0].message)
                    sent.pop("reasoning", None) if dialect == "groq" else None
                    messages = messages + _replay(sent)
                return seen

            seen = await deferToThread(session)
            ids = [call.id for answer, _, _ in seen for call in answer.choices[0].message.tool_calls]
            self.assertTrue(all(re.fullmatch(ID_SHAPES[dialect], call_id) for call_id in ids), (dialect, ids))
            self.assertLess(len(set(ids)), len(ids), f"{dialect}: the fake model reuses ids")
            for answer, streamed, chunks in seen:
                self.assertEqual(answer.choices[0].finish_reason, "tool_calls")
                if streamed is None:
                    continue
                self.assertEqual(_sdk_message(streamed.choices[0].message), _sdk_message(answer.choices[0].message),
                                 dialect)
                self.assertEqual(chunks[-1].usage, answer.usage, dialect)
                self.assertEqual(chunks[-1].choices if not DIALECTS[dialect].usage_on_finish else [], [])
            totals = sim.reasoning.totals()
            if DIALECTS[dialect].required:
                self.assertEqual((totals["missing"], totals["foreign"], totals["refused"]), (0, 0, 0), dialect)
                self.assertEqual(totals["emitted"] - totals["unreturned"], 5, dialect)
            self.assertEqual(len(sim.reported.answers), 9, dialect)

    async def test_dialect_extras(self) -> None:
        """What each dialect adds beyond OpenAI's types reaches the SDK's ``model_extra``:
        DeepSeek's ``reasoning_content`` and cache counts, Gemini's thought signature on the
        first tool call, OpenRouter's ``reasoning_details``, Groq's parsed ``reasoning``."""
        found = {}
        for dialect in ("deepseek", "gemini", "openrouter", "groq"):
            _, url = self.serve(dialect)
            client = self.client(url)
            answer = await deferToThread(client.chat.completions.create, model=MODELS[dialect],
                                         messages=_first_messages(), tools=TOOLS, extra_body=REASONING_ON.get(dialect))
            found[dialect] = answer
        deepseek = found["deepseek"]
        self.assertTrue(deepseek.choices[0].message.model_extra["reasoning_content"])
        self.assertEqual(deepseek.usage.model_extra["prompt_cache_miss_tokens"], deepseek.usage.prompt_tokens)
        call = found["gemini"].choices[0].message.tool_calls[0]
        self.assertTrue(call.model_extra["extra_content"]["google"]["thought_signature"])
        details = found["openrouter"].choices[0].message.model_extra["reasoning_details"]
        self.assertEqual([entry["type"] for entry in details], ["reasoning.text", "reasoning.encrypted"])
        self.assertEqual(details[1]["id"], found["openrouter"].choices[0].message.tool_calls[0].id)
        self.assertTrue(found["groq"].choices[0].message.model_extra["reasoning"])

    async def test_refusals_reach_the_sdk(self) -> None:
        """A dialect's 400 is the SDK's ``BadRequestError`` with the dialect's body: DeepSeek's
        object, Gemini's one-element array, Mistral's flat error."""
        import openai

        cases = {
            "deepseek": DEEPSEEK_MISSING,
            "gemini": "Function call is missing a thought_signature",
            "mistral": "Tool call id was call_1 but must be a-z, A-Z, 0-9, with a length of 9.",
        }
        for dialect, text in cases.items():
            _, url = self.serve(dialect)
            client = self.client(url)
            messages = _first_messages() + [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]

            def call() -> Any:
                try:
                    return client.chat.completions.create(model=MODELS[dialect], messages=messages, tools=TOOLS)
                except openai.BadRequestError as error:
                    return error

            error = await deferToThread(call)
            self.assertIsInstance(error, openai.BadRequestError, dialect)
            self.assertIn(text, json.dumps(error.body), dialect)

    async def test_stream_usage_only_when_asked(self) -> None:
        """OpenAI streams usage only with ``stream_options.include_usage`` (a last chunk with
        no choices; ``"usage": null`` on the others); Mistral always, on its finish chunk."""

        def chunks(client, model: str, **options: Any) -> list:
            return list(client.chat.completions.create(model=model, messages=_first_messages(), stream=True,
                                                       **options))

        _, url = self.serve("openai")
        client = self.client(url)
        plain = await deferToThread(chunks, client, "gpt-4.1")
        self.assertTrue(all(chunk.usage is None for chunk in plain))
        asked = await deferToThread(chunks, client, "gpt-4.1", stream_options={"include_usage": True})
        self.assertEqual(asked[-1].choices, [])
        self.assertGreater(asked[-1].usage.prompt_tokens, 0)
        self.assertTrue(all(chunk.usage is None for chunk in asked[:-1]))
        _, url = self.serve("mistral")
        mistral = await deferToThread(chunks, self.client(url), "mistral-large-latest")
        self.assertEqual(mistral[-1].choices[0].finish_reason, "stop")
        self.assertGreater(mistral[-1].usage.completion_tokens, 0)

    async def test_error_midstream(self) -> None:
        """``stream_errors`` on the fake model: the stream ends with an error chunk, which the
        SDK raises as an ``APIError``; no usage was reported."""
        import openai

        sim, url = self.serve("openai", upstream_options={"stream_errors": 1.0})
        client = self.client(url)

        def read() -> Any:
            try:
                return list(client.chat.completions.create(model="gpt-4.1", messages=_first_messages(), tools=TOOLS,
                                                           stream=True, stream_options={"include_usage": True}))
            except openai.APIError as error:
                return error

        error = await deferToThread(read)
        self.assertIsInstance(error, openai.APIError)
        self.assertIn("The server had an error", str(error))
        self.assertEqual(len(sim.reported.answers), 0)


# -- in memory ------------------------------------------------------------------------------


def _events(data: bytes) -> list:
    """An SSE body as its events: parsed ``data:`` chunks, ``"[DONE]"``, ``":comment"`` lines."""
    events = []
    for event in data.decode("utf-8").split("\n\n"):
        if not event:
            continue
        for line in event.split("\n"):
            if line.startswith("data: "):
                value = line[6:]
                events.append(value if value == "[DONE]" else json.loads(value))
            else:
                events.append(line)
    return events


class _Chat:
    """A simulated Chat upstream behind StubTreq, paced by a Clock."""

    def __init__(self, dialect: str, *, upstream: dict | None = None, **options: Any):
        self.clock = Clock()
        self.dialect = dialect
        upstream_options = {"mode": "lenient", "id_style": "kimi" if dialect == "kimi" else "toolu",
                            "reactor": self.clock, **(upstream or {})}
        self.sim = SimulatedOpenAIChat(dialect, SimulatedUpstream(**upstream_options), **options)
        self.stub = StubTreq(self.sim.resource())

    def settle(self) -> None:
        for _ in range(10_000):
            self.stub.flush()
            if not self.clock.getDelayedCalls():
                break
            self.clock.advance(1)
        self.stub.flush()

    def post(self, body: Any, *, key: str | None = KEY, headers: dict | None = None,
             path: str = "/v1/chat/completions") -> tuple[int, Any]:
        """POST ``body``: the status and the parsed JSON, or the stream's events."""
        data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"content-type": "application/json", **(headers or {})}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        d = self.stub.request("POST", BASE + path, data=data, headers=headers)
        self.settle()
        response = _result(d)
        content = self.stub.content(response)
        self.settle()
        raw = _result(content)
        if response.headers.getRawHeaders("content-type", [""])[0].startswith("text/event-stream"):
            return response.code, _events(raw)
        return response.code, json.loads(raw)

    def body(self, messages: list, **extra: Any) -> dict:
        return {"model": MODELS[self.dialect], "messages": messages, "tools": TOOLS,
                **REASONING_ON.get(self.dialect, {}), **extra}

    def loop(self, turns: int, edit: Callable[[int, dict], dict] = lambda turn, message: message,
             **extra: Any) -> list[tuple[int, Any]]:
        """A tool loop of ``turns`` requests, each answer sent back through ``edit``."""
        messages = _first_messages()
        answers = []
        for turn in range(turns):
            status, answer = self.post(self.body(messages, **extra))
            answers.append((status, answer))
            if status != 200:
                break
            messages = messages + _replay(edit(turn, dict(answer["choices"][0]["message"])))
        return answers


def _tool_turn(dialect: str, **extra: Any) -> tuple[_Chat, list, dict]:
    """One answered tool turn: the upstream, the history up to it, its message."""
    chat = _Chat(dialect, **extra)
    status, answer = chat.post(chat.body(_first_messages()))
    assert status == 200, answer
    return chat, _first_messages(), answer["choices"][0]["message"]


class ReasoningRuleTests(SynchronousTestCase):
    """Each dialect's reasoning rule, its refusal in its words, and the tally."""

    def test_deepseek_requires_its_reasoning_back(self) -> None:
        """DeepSeek: an assistant tool-call message without its ``reasoning_content`` is its
        400; sent back whole, each turn's is its own; another turn's is tallied ``foreign``."""
        chat, history, message = _tool_turn("deepseek")
        self.assertTrue(message["reasoning_content"])
        bare = {key: value for key, value in message.items() if key != "reasoning_content"}
        status, body = chat.post(chat.body(history + _replay(bare)))
        self.assertEqual((status, body), (400, {"error": {
            "message": DEEPSEEK_MISSING, "type": "invalid_request_error", "param": None,
            "code": "invalid_request_error"}}))
        answers = chat.loop(4)
        self.assertEqual([status for status, _ in answers], [200] * 4)
        totals = chat.sim.reasoning.totals()
        self.assertEqual((totals["missing"], totals["refused"], totals["own"], totals["foreign"]), (1, 1, 6, 0))
        # Turn 0's reasoning on turn 1's message: accepted (DeepSeek cannot tell) but tallied.
        stolen = chat.loop(3, lambda turn, m: dict(m, reasoning_content=message["reasoning_content"]) if turn == 1
                           else m)
        self.assertEqual([status for status, _ in stolen], [200] * 3)
        self.assertEqual(chat.sim.reasoning.totals()["foreign"], 1)
        self.assertEqual(chat.sim.reasoning.problems[-1].verdict, "foreign")

    def test_deepseek_without_thinking(self) -> None:
        """``thinking: {"type": "disabled"}``: no ``reasoning_content`` out, none required."""
        chat = _Chat("deepseek")
        answers = chat.loop(3, thinking={"type": "disabled"})
        self.assertEqual([status for status, _ in answers], [200] * 3)
        self.assertNotIn("reasoning_content", answers[0][1]["choices"][0]["message"])
        self.assertEqual(chat.sim.reasoning.totals()["requests"], 0)

    def test_deepseek_refuses_images(self) -> None:
        """DeepSeek's Chat API takes no image: its deserializer's 400, naming the message and
        where in the body it stopped."""
        chat = _Chat("deepseek")
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
        raw = json.dumps(chat.body(messages), separators=(",", ":")).encode()
        status, body = chat.post(raw)
        column = raw.index(b'"type":"image_url"') + len(b'"type":"image_url"')
        self.assertEqual(status, 400)
        self.assertEqual(body["error"]["message"], "Failed to deserialize the JSON body into the target type: "
                         f"messages[0]: unknown variant `image_url`, expected `text` at line 1 column {column}")

    def test_kimi_names_the_message(self) -> None:
        """Kimi: ``functions.<name>:<n>`` ids; a tool-call message without its
        ``reasoning_content`` is a 400 naming its index."""
        chat = _Chat("kimi")
        answers = chat.loop(3)
        self.assertEqual([status for status, _ in answers], [200] * 3)
        first = answers[0][1]["choices"][0]["message"]
        self.assertRegex(first["tool_calls"][0]["id"], r"^functions\.[A-Za-z_]+:0$")
        status, body = chat.loop(3, lambda turn, m: {k: v for k, v in m.items() if k != "reasoning_content"}
                                 if turn == 1 else m)[-1]
        self.assertEqual((status, body), (400, {"error": {
            "message": "thinking is enabled but reasoning_content is missing in assistant tool call message at "
                       "index 4", "type": "invalid_request_error"}}))

    def test_gemini_signatures(self) -> None:
        """Gemini: a thought signature on the first tool call of each step; a call of the
        current turn without it is its 400 (a Google status in an array) naming the function
        and position; another account's is corrupted; the documented dummy is taken; a step
        before the last user message needs none."""
        chat, history, message = _tool_turn("gemini", accounts={KEY: "acme", OTHER_KEY: "other"})
        call = message["tool_calls"][0]
        self.assertIn("thought_signature", call["extra_content"]["google"])

        def with_signature(signature: Any) -> dict:
            first = {k: v for k, v in call.items() if k != "extra_content"}
            if signature is not None:
                first["extra_content"] = {"google": {"thought_signature": signature}}
            return dict(message, tool_calls=[first, *message["tool_calls"][1:]])

        status, body = chat.post(chat.body(history + _replay(with_signature(None))))
        self.assertEqual(status, 400)
        self.assertEqual(body[0]["error"]["status"], "INVALID_ARGUMENT")
        self.assertIn("Function call is missing a thought_signature in functionCall parts.", body[0]["error"]["message"])
        self.assertIn(f"function call `default_api:{call['function']['name']}` , position 2.",
                      body[0]["error"]["message"])
        status, body = chat.post(chat.body(history + _replay(message)), key=OTHER_KEY)
        self.assertEqual((status, body[0]["error"]["message"]), (400, GEMINI_CORRUPTED))
        status, _ = chat.post(chat.body(history + _replay(with_signature("skip_thought_signature_validator"))))
        self.assertEqual(status, 200)
        later = history + _replay(with_signature(None))[:-1] + [
            {"role": "tool", "tool_call_id": call["id"], "content": "ok"}, {"role": "user", "content": "Et demain ?"}]
        self.assertEqual(chat.post(chat.body(later))[0], 200)
        totals = chat.sim.reasoning.totals()
        self.assertEqual((totals["missing"], totals["foreign"], totals["skipped"], totals["refused"]), (1, 1, 1, 2))

    def test_openrouter_details_unmodified(self) -> None:
        """OpenRouter: ``reasoning_details`` back unmodified on the current turn's tool calls;
        missing or edited, its 400 quoting its provider's."""
        chat, history, message = _tool_turn("openrouter")
        self.assertEqual(chat.post(chat.body(history + _replay(message)))[0], 200)
        edited = dict(message, reasoning_details=message["reasoning_details"][1:])
        for sent, raw in ((edited, GEMINI_CORRUPTED),
                          ({k: v for k, v in message.items() if k != "reasoning_details"}, "missing a thought_signature")):
            status, body = chat.post(chat.body(history + _replay(sent)))
            self.assertEqual(status, 400)
            self.assertEqual(body["error"]["message"], "Provider returned error")
            self.assertEqual(body["error"]["metadata"]["provider_name"], "Google AI Studio")
            self.assertIn(raw, body["error"]["metadata"]["raw"])

    def test_groq(self) -> None:
        """Groq: ``reasoning`` only with ``reasoning_format: "parsed"`` (``raw``: in ``<think>``);
        ``reasoning_content`` sent back, or any field it does not know, is its 400."""
        chat, history, message = _tool_turn("groq")
        self.assertTrue(message["reasoning"])
        status, body = chat.post(chat.body(history + _replay(dict(message, reasoning_content="x"))))
        self.assertEqual((status, body["error"]["message"]), (400, "'messages.2' : for 'role:assistant' the "
                         "following must be satisfied[('messages.2' : property 'reasoning' is unsupported)]"))
        bare = {k: v for k, v in message.items() if k != "reasoning"}
        status, body = chat.post(chat.body(history + _replay(dict(bare, reasoning_content="x"))))
        self.assertIn("property 'reasoning_content' is unsupported", body["error"]["message"])
        status, body = chat.post(chat.body(history, store=False))
        self.assertEqual((status, body), (400, {"error": {"message": "property 'store' is unsupported",
                                                          "type": "invalid_request_error"}}))
        plain = _Chat("groq").post({"model": MODELS["groq"], "messages": _first_messages()})[1]
        self.assertNotIn("reasoning", plain["choices"][0]["message"])
        raw = _Chat("groq").post({"model": MODELS["groq"], "messages": _first_messages(), "reasoning_format": "raw"})
        self.assertTrue(raw[1]["choices"][0]["message"]["content"].startswith("<think>"))

    def test_conversations_apart(self) -> None:
        """The tally keeps conversations apart: by Claude Code's session header, else the
        first user message."""
        chat, history, message = _tool_turn("deepseek")
        chat.post(chat.body(history + _replay(message)), headers={"x-claude-code-session-id": "s-1"})
        chat.post(chat.body(history + _replay(message)))
        conversations = chat.sim.reasoning.conversations()
        self.assertEqual(len(conversations), 2)
        self.assertEqual(conversations["session:s-1"]["own"], 1)


class DialectRuleTests(SynchronousTestCase):
    """The refusals that are not about reasoning."""

    def test_mistral_ids(self) -> None:
        """Mistral makes 9-character ids and refuses any other, in a call or a tool message."""
        chat = _Chat("mistral")
        answers = chat.loop(4)
        ids = [call["id"] for _, answer in answers for call in answer["choices"][0]["message"]["tool_calls"]]
        self.assertTrue(all(re.fullmatch(r"[A-Za-z0-9]{9}", call_id) for call_id in ids), ids)
        history = _first_messages() + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_01abc", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "toolu_01abc", "content": "ok"}]
        status, body = chat.post(chat.body(history))
        self.assertEqual((status, body), (400, {
            "object": "error", "message": "Tool call id was toolu_01abc but must be a-z, A-Z, 0-9, with a length "
            "of 9.", "type": "invalid_function_call", "param": None, "code": "3280"}))

    def test_gemini_function_schema(self) -> None:
        """Gemini's function parameters are its Schema (a subset of OpenAPI 3.0): each JSON Schema keyword it
        lacks is a line of one 400, where Gemini names it (llmgateway #1763: Claude Code's tools)."""
        chat = _Chat("gemini")
        read = {"type": "function", "function": {"name": "Read", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["file_path"],
            "properties": {"file_path": {"type": "string"},
                           "limit": {"type": "integer", "exclusiveMinimum": 0},
                           "paths": {"type": "array", "items": {"type": "string", "const": "a"}},
                           "mode": {"anyOf": [{"type": "string", "propertyNames": {}}, {"type": "integer"}]}}}}}
        status, body = chat.post(chat.body(_first_messages(), tools=[TOOLS[0], read]))
        where = "tools[0].function_declarations[1].parameters"
        self.assertEqual((status, body), (400, [{"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "\n".join(
            'Invalid JSON payload received. Unknown name "%s" at \'%s\': Cannot find field.' % (name, path) for name, path in (
                ("additionalProperties", where), ("exclusiveMinimum", where + ".properties[1].value"),
                ("const", where + ".properties[2].value.items"),
                ("propertyNames", where + ".properties[3].value.any_of[0]")))}}]))
        # What its Schema has passes.
        read["function"]["parameters"] = {
            "type": "object", "required": ["file_path"], "properties": {
                "file_path": {"type": "string", "description": "A path.", "format": "date-time"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 9007199254740991, "nullable": True},
                "paths": {"type": "array", "items": {"type": "string", "enum": ["a"]}, "minItems": 1}}}
        self.assertEqual(chat.post(chat.body(_first_messages(), tools=[TOOLS[0], read]))[0], 200)

    def test_openai_ids_at_most_40(self) -> None:
        """OpenAI takes tool call ids of at most 40 characters (an Anthropic id is longer)."""
        chat = _Chat("openai")
        long_id = "toolu_01" + "A" * 33
        history = _first_messages() + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": long_id, "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": long_id, "content": "ok"}]
        status, body = chat.post(chat.body(history))
        self.assertEqual((status, body), (400, {"error": {
            "message": "Invalid 'messages[2].tool_calls[0].id': string too long. Expected a string with maximum "
                       "length 40, but got a string with length 41 instead.", "type": "invalid_request_error",
            "param": "messages[2].tool_calls[0].id", "code": "string_above_max_length"}}))
        history[2]["tool_calls"][0]["id"] = history[3]["tool_call_id"] = long_id[:40]
        self.assertEqual(chat.post(chat.body(history))[0], 200)

    def test_gpt_reasoning_models(self) -> None:
        """GPT-5.6 on Chat: function tools with reasoning on (its default) are refused as OpenAI
        refuses them, so are ``max_tokens`` and a temperature; ``reasoning_effort: "none"``
        takes tools; its reasoning shows only as tokens."""
        chat = _Chat("openai")
        body = {"model": "gpt-5.6-terra", "messages": _first_messages(), "tools": TOOLS}
        status, error = chat.post(body)
        self.assertEqual((status, error), (400, {"error": {
            "message": "Function tools with reasoning_effort are not supported for gpt-5.6-terra in "
                       "/v1/chat/completions. To use function tools, use /v1/responses or set reasoning_effort "
                       "to 'none'.", "type": "invalid_request_error", "param": "reasoning_effort", "code": None}}))
        self.assertEqual(chat.post(dict(body, reasoning_effort="none"))[0], 200)
        status, error = chat.post(dict(body, reasoning_effort="none", max_tokens=100))
        self.assertEqual(error["error"]["code"], "unsupported_parameter")
        status, answer = chat.post({"model": "gpt-5.6-terra", "messages": _first_messages()})
        self.assertGreater(answer["usage"]["completion_tokens_details"]["reasoning_tokens"], 0)
        self.assertNotIn("reasoning_content", answer["choices"][0]["message"])
        self.assertEqual(chat.post({"model": "gpt-5.6-terra", "messages": _first_messages(), "temperature": 0.2})[1]
                         ["error"]["param"], "temperature")

    def test_tool_messages_pair(self) -> None:
        """A tool message must answer the calls just before it, all of them (OpenAI's words,
        every dialect)."""
        chat = _Chat("deepseek")
        orphan = _first_messages() + [{"role": "tool", "tool_call_id": "call_x", "content": "ok"}]
        status, body = chat.post(chat.body(orphan))
        self.assertEqual((status, body["error"]["message"]), (400, "Invalid parameter: messages with role 'tool' "
                         "must be a response to a preceeding message with 'tool_calls'."))
        _, history, message = _tool_turn("openai")
        unanswered = history + [message, {"role": "user", "content": "?"}]
        status, body = _Chat("openai").post(_Chat("openai").body(unanswered))
        self.assertEqual(status, 400)
        self.assertIn("The following tool_call_ids did not have response messages: "
                      + message["tool_calls"][0]["id"], body["error"]["message"])

    def test_keys(self) -> None:
        """``Authorization: Bearer`` is required, with a key taken; the key is never echoed."""
        chat = _Chat("openai", keys=[KEY])
        status, body = chat.post(chat.body(_first_messages()), key=None)
        self.assertEqual(status, 401)
        self.assertIn("You didn't provide an API key", body["error"]["message"])
        status, body = chat.post(chat.body(_first_messages()), key="sk-wrong-secret")
        self.assertEqual((status, body["error"]["code"]), (401, "invalid_api_key"))
        self.assertNotIn("sk-wrong-secret", json.dumps(body))
        self.assertEqual(chat.post(chat.body(_first_messages()), path="/v1/responses")[0], 404)

    def test_malformed_bodies(self) -> None:
        """A body of the wrong shape is a 400 in the dialect's envelope, never a 500."""
        hi = {"role": "user", "content": "hi"}
        bodies = [b"{not json", [], {"model": 3}, {"model": "m", "messages": {}}, {"model": "m", "messages": ["x"]},
                  {"model": "m", "messages": [{"role": "user"}]}, {"model": "m", "messages": [{"role": "user",
                                                                                              "content": ["x"]}]},
                  {"model": "m", "messages": [hi, {"role": "assistant", "tool_calls": {"a": 1}}]},
                  {"model": "m", "messages": [hi, {"role": "assistant", "tool_calls": [{"id": "a"}]}]},
                  {"model": "m", "messages": [hi, {"role": "assistant", "content": [{"type": "text", "text": 4}]}]},
                  {"model": "m", "messages": [hi, {"role": "tool", "content": "x"}]},
                  {"model": "m", "messages": [hi], "tools": "x"}, {"model": "m", "messages": [hi], "max_tokens": "x"}]
        for dialect in DIALECTS:
            for body in bodies:
                status, error = _Chat(dialect).post(body)
                self.assertEqual(status, 400, (dialect, body))
                self.assertTrue(error, (dialect, body))
        status, error = _Chat("openai").post({"model": "m", "messages": [hi, {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "Bash"}}]}]})
        self.assertEqual(error["error"]["message"], "Invalid type for 'messages[1].tool_calls[0].function.arguments': "
                         "expected a string, but got null instead.")

    def test_settings(self) -> None:
        """An unknown dialect or index mode, a fake model that checks ids itself, Kimi without
        its id style: refused at construction."""
        with self.assertRaises(ValueError):
            SimulatedOpenAIChat("xai")
        with self.assertRaises(ValueError):
            SimulatedOpenAIChat("openai", tool_call_index="sometimes")
        with self.assertRaises(ValueError):
            SimulatedOpenAIChat("openai", SimulatedUpstream(mode="strict"))
        with self.assertRaises(ValueError):
            SimulatedOpenAIChat("kimi", SimulatedUpstream(mode="lenient"))


def _data(events: list) -> list[dict]:
    return [event for event in events if isinstance(event, dict)]


def _calls(events: list) -> list[dict]:
    return [call for chunk in _data(events) for choice in chunk.get("choices", ())
            for call in choice["delta"].get("tool_calls") or ()]


class StreamTests(SynchronousTestCase):
    """The stream's shape, its switches and its usage."""

    def stream(self, dialect: str = "openai", body_extra: dict | None = None, **options: Any) -> tuple[_Chat, list]:
        chat = _Chat(dialect, **options)
        status, events = chat.post(chat.body(_first_messages(), stream=True, **(body_extra or {})))
        self.assertEqual(status, 200)
        return chat, events

    def test_openai_stream(self) -> None:
        """``data:`` lines only, ``[DONE]`` last; a tool call's id and name in its first delta,
        its arguments in pieces that make the whole; the streamed answer is the answer."""
        chat, events = self.stream(upstream={"parallel": 2, "reuse_every": 0})
        self.assertEqual(events[-1], "[DONE]")
        self.assertTrue(all(isinstance(event, dict) for event in events[:-1]))
        whole = chat.post(chat.body(_first_messages()))[1]["choices"][0]["message"]
        for number, call in enumerate(whole["tool_calls"]):
            deltas = [delta for delta in _calls(events) if delta["index"] == number]
            self.assertEqual((deltas[0]["id"], deltas[0]["function"]["name"]), (call["id"], call["function"]["name"]))
            self.assertGreater(len(deltas), 2)
            self.assertEqual("".join(delta["function"]["arguments"] for delta in deltas), call["function"]["arguments"])
        text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in _data(events))
        self.assertEqual(text, whole["content"])
        self.assertEqual(_data(events)[-1]["choices"][0]["finish_reason"], "tool_calls")

    def test_one_call_when_asked(self) -> None:
        """``parallel_tool_calls: false``: one tool call per answer."""
        chat = _Chat("openai", upstream={"parallel": 3})
        many = chat.post(chat.body(_first_messages()))[1]["choices"][0]["message"]["tool_calls"]
        one = chat.post(chat.body(_first_messages(), parallel_tool_calls=False))[1]["choices"][0]["message"]
        self.assertEqual((len(many), one["tool_calls"]), (3, many[:1]))

    def test_index_and_late_ids(self) -> None:
        """The switches: tool calls without ``index``, all at index 0, ids a delta late."""
        _, missing = self.stream(upstream={"parallel": 2}, tool_call_index="missing")
        self.assertTrue(_calls(missing) and all("index" not in delta for delta in _calls(missing)))
        _, duplicated = self.stream(upstream={"parallel": 2}, tool_call_index="duplicated")
        self.assertEqual({delta["index"] for delta in _calls(duplicated)}, {0})
        self.assertEqual(len([delta for delta in _calls(duplicated) if "id" in delta]), 2)
        _, late = self.stream(late_ids=True)
        calls = _calls(late)
        self.assertEqual(("id" in calls[0], "name" in calls[0]["function"], "id" in calls[1]), (False, True, True))

    def test_whole_calls(self) -> None:
        """Gemini and Mistral stream each call whole in one delta (Gemini's signature on it)."""
        for dialect in ("gemini", "mistral"):
            _, events = self.stream(dialect)
            calls = _calls(events)
            self.assertEqual(len(calls), 1)
            json.loads(calls[0]["function"]["arguments"])
        self.assertIn("extra_content", _calls(self.stream("gemini")[1])[0])

    def test_reasoning_streams(self) -> None:
        """DeepSeek streams ``reasoning_content`` (content null) before the text; OpenRouter
        ``reasoning`` with ``reasoning_details`` pieces that merge by index into the answer's,
        after a comment line."""
        chat, events = self.stream("deepseek")
        whole = chat.post(chat.body(_first_messages()))[1]["choices"][0]["message"]
        pieces = [chunk["choices"][0]["delta"] for chunk in _data(events) if chunk["choices"]
                  and "reasoning_content" in chunk["choices"][0]["delta"]]
        self.assertEqual("".join(delta["reasoning_content"] for delta in pieces), whole["reasoning_content"])
        self.assertTrue(all(delta["content"] is None for delta in pieces))
        chat, events = self.stream("openrouter")
        whole = chat.post(chat.body(_first_messages()))[1]["choices"][0]["message"]
        self.assertEqual(events[0], ": OPENROUTER PROCESSING")
        merged: dict[int, dict] = {}
        for chunk in _data(events):
            for entry in chunk["choices"][0]["delta"].get("reasoning_details", ()) if chunk["choices"] else ():
                if entry["index"] in merged:
                    merged[entry["index"]]["text"] += entry["text"]
                else:
                    merged[entry["index"]] = dict(entry)
        self.assertEqual([merged[index] for index in sorted(merged)], whole["reasoning_details"])

    def test_cut_and_dropped(self) -> None:
        """``stream_errors``: an error chunk ends the stream, no ``[DONE]``; ``stream_cuts``:
        the connection drops; neither reports usage."""
        chat, events = self.stream(upstream={"stream_errors": 1.0}, body_extra={"stream_options": {
            "include_usage": True}})
        self.assertEqual(events[-1]["error"]["type"], "server_error")
        self.assertNotIn("[DONE]", events)
        self.assertEqual(len(chat.sim.reported.answers), 0)
        chat = _Chat("openai", upstream={"stream_cuts": 1.0})
        with self.assertRaises(ResponseFailed):
            chat.post(chat.body(_first_messages(), stream=True, stream_options={"include_usage": True}))
        self.assertEqual(len(chat.sim.reported.answers), 0)


class UsageTests(SynchronousTestCase):
    """The usage each dialect reports, and the tally in Anthropic's terms."""

    def test_cache_reads(self) -> None:
        """A long prompt sent again is read from the cache: OpenAI's ``cached_tokens`` (within
        ``prompt_tokens``) and ``cache_write_tokens``, DeepSeek's hit and miss counts, Kimi's
        ``cached_tokens``; the tally holds each as a relay should meter it."""
        for dialect in ("openai", "deepseek", "kimi"):
            chat = _Chat(dialect)
            messages = _first_messages(LONG_SYSTEM)
            first = chat.post(chat.body(messages))[1]
            messages = messages + _replay(first["choices"][0]["message"])
            second = chat.post(chat.body(messages))[1]
            usage = second["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            self.assertGreater(cached, 500, dialect)
            self.assertLess(cached, usage["prompt_tokens"])
            if dialect == "openai":
                self.assertGreater(first["usage"]["prompt_tokens_details"]["cache_write_tokens"], 500)
            if dialect == "deepseek":
                self.assertEqual((usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]),
                                 (cached, usage["prompt_tokens"] - cached))
            if dialect == "kimi":
                self.assertEqual(usage["cached_tokens"], cached)
            tallied = chat.sim.reported.answers[-1].usage
            written = usage["prompt_tokens_details"].get("cache_write_tokens", 0)
            self.assertEqual(tallied, {"input_tokens": usage["prompt_tokens"] - cached - written,
                                       "output_tokens": usage["completion_tokens"],
                                       "cache_read_input_tokens": cached,
                                       "cache_creation_input_tokens": written})

    def test_reasoning_counts_as_output(self) -> None:
        """Reasoning tokens are part of ``completion_tokens``."""
        chat, _, _ = _tool_turn("deepseek")
        answer = chat.sim.answers[-1]
        reasoning = answer.usage["completion_tokens_details"]["reasoning_tokens"]
        self.assertGreater(reasoning, 0)
        self.assertEqual(answer.usage["completion_tokens"], answer.message["usage"]["output_tokens"] + reasoning)
