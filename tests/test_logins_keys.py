"""
Tests for :mod:`twisted_relay.logins.keys`: a static key in named headers,
the client's own credentials removed.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.http_headers import Headers

from twisted_relay.logins.keys import KeyLogin

KEY = "azure-key-0123456789abcdef"
URL = "https://res.services.ai.azure.com/anthropic/v1/messages"


def client_headers() -> Headers:
    """What a client sends: its own credentials beside the API's headers."""
    return Headers(
        {
            b"x-api-key": [b"sk-ant-client-own-key"],
            b"authorization": [b"Bearer client-token"],
            b"api-key": [b"client-azure-key"],
            b"anthropic-version": [b"2023-06-01"],
            b"anthropic-beta": [b"context-1m-2025-08-07"],
            b"content-type": [b"application/json"],
        }
    )


def credentials_of(headers: Headers) -> dict[str, list[str]]:
    """Every header but those the login must leave alone."""
    left_alone = {b"anthropic-version", b"anthropic-beta", b"content-type"}
    return {
        name.decode(): [value.decode() for value in values]
        for name, values in headers.getAllRawHeaders()
        if name.lower() not in left_alone
    }


class KeyLoginTests(SynchronousTestCase):
    """A key login sets exactly its headers and nothing of the client's survives."""

    def test_foundry_sends_the_key_in_both_headers(self) -> None:
        """Foundry's login puts the key in x-api-key and api-key, and removes the client's Authorization."""
        headers = client_headers()
        KeyLogin.foundry(KEY).authorize(b"POST", URL, headers, b"{}")
        self.assertEqual(credentials_of(headers), {"X-Api-Key": [KEY], "Api-Key": [KEY]})

    def test_anthropic_aws_sends_the_workspace(self) -> None:
        """Claude Platform on AWS: the key in x-api-key and the workspace id; no api-key, no Authorization."""
        headers = client_headers()
        KeyLogin.anthropic_aws(KEY, "wrkspc_01abc").authorize(b"POST", URL, headers, None)
        self.assertEqual(
            credentials_of(headers), {"X-Api-Key": [KEY], "Anthropic-Workspace-Id": ["wrkspc_01abc"]}
        )

    def test_other_headers_pass(self) -> None:
        """The API's own headers are left as the client sent them."""
        headers = client_headers()
        KeyLogin.foundry(KEY).authorize(b"POST", URL, headers, b"{}")
        self.assertEqual(headers.getRawHeaders(b"anthropic-beta"), [b"context-1m-2025-08-07"])
        self.assertEqual(headers.getRawHeaders(b"anthropic-version"), [b"2023-06-01"])

    def test_named_headers(self) -> None:
        """Any header names and fixed headers can be configured; names are case-insensitive."""
        headers = client_headers()
        KeyLogin(KEY, ["X-Custom-Key"], {"X-Team": "blue"}).authorize(b"POST", URL, headers, None)
        self.assertEqual(credentials_of(headers), {"X-Custom-Key": [KEY], "X-Team": ["blue"]})

    def test_repr_hides_the_key(self) -> None:
        """The key is never in the login's repr; the header names and the workspace are."""
        text = repr(KeyLogin.anthropic_aws(KEY, "wrkspc_01abc"))
        self.assertNotIn(KEY, text)
        self.assertIn("x-api-key", text)
        self.assertIn("wrkspc_01abc", text)

    def test_bad_key_refused_without_showing_it(self) -> None:
        """A key that cannot be a header value is refused at construction, its value unshown."""
        bad = "secret-part\r\nx-injected: 1"
        with self.assertRaises(ValueError) as caught:
            KeyLogin.foundry(bad)
        self.assertNotIn("secret-part", str(caught.exception))
        self.assertRaises(ValueError, KeyLogin.foundry, "")
        self.assertRaises(ValueError, KeyLogin, KEY, [])
        self.assertRaises(ValueError, KeyLogin, KEY, ["bad name"])
        self.assertRaises(ValueError, KeyLogin.anthropic_aws, KEY, "")
