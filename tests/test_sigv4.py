"""
Tests of the relay's own SigV4 signer (twisted_relay.logins.sigv4) against
botocore's ``SigV4Auth``, the reference: the same Authorization header for
the same request, over Bedrock's model ids (ARNs, inference profiles, ``:``
raw or encoded), query strings, header values, bodies, ports and session
tokens; and the peers' bugs (BerriAI/litellm #13738, #27513; vercel/ai
#17410) each as a case.
"""

from __future__ import annotations

import hashlib
import string
from urllib.parse import quote, unquote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from hypothesis import given, settings, strategies as st
from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.logins.sigv4 import (
    EMPTY_SHA256,
    UNSIGNED,
    SigV4Signer,
    amz_date,
    canonical_path,
    canonical_query,
    wire_host,
)

AKID = "AKIDEXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
TOKEN = "IQoJb3JpZ2luX2VjEXAMPLE//////////wEaCXVzLWVhc3QtMSJHMEUCIQD+session/token=="
DATE = "20261204T101500Z"
RUNTIME = "https://bedrock-runtime.us-east-1.amazonaws.com"

#: Model ids as they go in the URL path: the Anthropic SDK's
#: ``quote(model, safe=":")`` and boto3's (``:`` encoded too).
MODEL_PATHS = [
    "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/invoke",
    "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke",
    "/model/global.anthropic.claude-opus-4-6-v1/invoke-with-response-stream",
    "/model/us.anthropic.claude-haiku-4-5-20251001-v1:0/invoke-with-response-stream",
    "/model/eu.anthropic.claude-sonnet-4-5-20250929-v1:0/count-tokens",
    "/model/us.anthropic.claude-opus-4-8/invoke",
    "/model/arn:aws:bedrock:us-east-1:123456789012:application-inference-profile%2Fhq2of259skzs/invoke",
    "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Aapplication-inference-profile%2Fhq2of259skzs/invoke",
    "/model/arn:aws:bedrock:us-west-2:123456789012:inference-profile%2Fus.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke",
    "/model/arn:aws:bedrock:us-east-1::foundation-model%2Fanthropic.claude-3-5-haiku-20241022-v1:0/invoke",
    "/model/arn:aws:bedrock:us-east-1:123456789012:provisioned-model%2Fabc123def456/invoke-with-response-stream",
    "/anthropic/v1/messages",
    "/v1/messages/count_tokens",
    "/",
    "",
]


def botocore_authorization(method, url, headers, body, token=None, service="bedrock", region="us-east-1", params=None):
    """
    What botocore signs for a request whose ``x-amz-date`` (and token) are
    already set, at that date (as the Bedrock simulator verifies).
    ``headers`` is a list of (name, value) pairs: a name given twice is sent
    twice.
    """
    request = AWSRequest(method=method, url=url, data=body, params=params or {})
    for name, value in headers:
        request.headers[name] = value  # HTTPHeaders: a second value for a name is kept beside the first
    request.context["timestamp"] = DATE
    auth = SigV4Auth(Credentials(AKID, SECRET, token), service, region)
    canonical = auth.canonical_request(request)
    signature = auth.signature(auth.string_to_sign(request, canonical), request)
    return "AWS4-HMAC-SHA256 Credential=%s, SignedHeaders=%s, Signature=%s" % (
        auth.scope(request),
        auth.signed_headers(auth.headers_to_sign(request)),
        signature,
    )


def grouped(headers):
    """(name, value) pairs as Twisted's ``getAllRawHeaders()`` gives them: each name once, its values in order."""
    found: dict[bytes, list[bytes]] = {}
    names: dict[bytes, bytes] = {}
    for name, value in headers:
        key = name.lower().encode()
        names.setdefault(key, name.encode())
        found.setdefault(key, []).append(value.encode())
    return [(names[key], values) for key, values in found.items()]


def relay_authorization(method, url, headers, body, service="bedrock", region="us-east-1", signer=None):
    signer = signer or SigV4Signer(service, region)
    return signer.authorization(method.encode(), url, grouped(headers), body, AKID, SECRET, DATE).decode()


def dated(headers, token=None):
    """``headers`` with ``x-amz-date`` (and the session token) as the login sets them."""
    extra = [("X-Amz-Date", DATE)] + ([("X-Amz-Security-Token", token)] if token else [])
    return list(headers) + extra


class SignerAgainstBotocoreTests(SynchronousTestCase):
    """The same Authorization header as botocore's SigV4Auth, case by case."""

    def assertSameAsBotocore(self, method, url, headers, body, token=None, service="bedrock", region="us-east-1"):
        headers = dated(headers, token)
        expected = botocore_authorization(method, url, headers, body, token, service, region)
        self.assertEqual(relay_authorization(method, url, headers, body, service, region), expected, url)

    def test_model_ids_arns_and_profiles(self):
        """
        Every form of model id in the path (vercel/ai #17410: an ARN's
        ``/`` goes out as ``%2F`` and is signed as ``%252F``; ``:`` raw is
        signed ``%3A``, ``%3A`` is signed ``%253A``).
        """
        body = b'{"anthropic_version":"bedrock-2023-05-31","max_tokens":16,"messages":[]}'
        headers = [("Content-Type", "application/json"), ("Accept", "application/json")]
        for path in MODEL_PATHS:
            self.assertSameAsBotocore("POST", RUNTIME + path, headers, body)

    def test_arn_slash_signed_double_encoded(self):
        """The canonical path of an ARN keeps ``%2F`` encoded once more: ``%252F``."""
        path = "/model/arn:aws:bedrock:us-east-1:123456789012:application-inference-profile%2Fabc/invoke"
        self.assertEqual(
            canonical_path(path),
            "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Aapplication-inference-profile%252Fabc/invoke",
        )

    def test_raw_and_encoded_colon_are_different_requests(self):
        """
        ``v1:0`` and ``v1%3A0`` on the wire are signed differently (litellm
        #13738 signed one and sent the other), each as botocore signs it.
        """
        raw = RUNTIME + "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke"
        encoded = RUNTIME + "/model/us.anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
        headers = dated([("Content-Type", "application/json")])
        self.assertNotEqual(
            relay_authorization("POST", raw, headers, b"{}"), relay_authorization("POST", encoded, headers, b"{}")
        )
        self.assertEqual(canonical_path("/v1:0"), "/v1%3A0")
        self.assertEqual(canonical_path("/v1%3A0"), "/v1%253A0")

    def test_services_and_regions(self):
        """Each AWS surface's signing name and its region are in the scope."""
        cases = [
            ("bedrock", "us-east-1", RUNTIME + "/model/global.anthropic.claude-opus-4-6-v1/invoke"),
            ("bedrock", "eu-central-1", "https://bedrock-runtime.eu-central-1.amazonaws.com/anthropic/v1/messages"),
            ("bedrock-mantle", "us-west-2", "https://bedrock-mantle.us-west-2.api.aws/anthropic/v1/messages"),
            ("aws-external-anthropic", "us-east-1", "https://aws-external-anthropic.us-east-1.api.aws/v1/messages"),
        ]
        headers = [("content-type", "application/json"), ("anthropic-version", "2023-06-01")]
        for service, region, url in cases:
            self.assertSameAsBotocore("POST", url, headers, b'{"model":"m"}', service=service, region=region)
            self.assertIn(
                "/%s/%s/aws4_request," % (region, service),
                relay_authorization("POST", url, dated(headers), b"", service, region),
            )

    def test_query_strings_in_canonical_form(self):
        """Queries already in AWS's canonical encoding sign as botocore signs them from the URL."""
        for query in [
            "a=1",
            "b=2&a=1",
            "a=2&a=1&a=10",
            "type=SYSTEM_DEFINED&maxResults=10",
            "after_id=msg%2Fx&limit=20",
            "empty=&a=b",
            "name=with%20space",
            "k=%E2%9C%93",
            "flag",
        ]:
            self.assertSameAsBotocore("GET", RUNTIME + "/inference-profiles?" + query, [], None)

    def test_query_strings_canonicalized_as_aws_does(self):
        """
        A query not in canonical form (lower-case escapes, a raw ``/`` or
        ``:``) is signed as AWS canonicalizes it: the same as botocore signs
        those names and values given as parameters.
        """
        for query in ["a=b%2fc", "t=10:00&a=x/y", "x=~tilde&y=a*b", "q=%7e"]:
            url = RUNTIME + "/inference-profiles?" + query
            params = [tuple(unquote(part) for part in pair.split("=", 1)) for pair in query.split("&")]
            headers = dated([])
            expected = botocore_authorization("GET", RUNTIME + "/inference-profiles", headers, None, params=params)
            self.assertEqual(relay_authorization("GET", url, headers, None), expected, query)

    def test_header_values_trimmed_and_inner_spaces_made_one(self):
        """Values with leading, trailing and inner runs of spaces and tabs (sent as they are, signed trimmed)."""
        headers = [
            ("Content-Type", "  application/json  "),
            ("X-Amzn-Bedrock-Trace", "ENABLED"),
            ("anthropic-beta", "a-2025-01-01,   b-2025-02-02"),
            ("X-Custom", " one \t two   three "),
            ("X-Empty", ""),
        ]
        self.assertSameAsBotocore("POST", RUNTIME + MODEL_PATHS[0], headers, b"{}")

    def test_a_header_sent_twice_signs_comma_joined(self):
        """
        A header the relay sends twice is signed as AWS reads it, the values
        comma-joined (litellm #13738's ``application/json, application/json``).
        """
        headers = [("Content-Type", "application/json"), ("content-type", "application/json")]
        self.assertSameAsBotocore("POST", RUNTIME + MODEL_PATHS[3], headers, b"{}")

    def test_empty_bodies(self):
        """No body and an empty body both sign the SHA-256 of nothing."""
        for body in (None, b""):
            self.assertSameAsBotocore("POST", RUNTIME + MODEL_PATHS[0], [("content-type", "application/json")], body)
            self.assertSameAsBotocore("GET", RUNTIME + "/inference-profiles", [], body)
        self.assertEqual(EMPTY_SHA256, hashlib.sha256(b"").hexdigest())

    def test_large_and_binary_bodies(self):
        """The body's exact bytes are hashed, whatever they hold."""
        for body in (bytes(range(256)) * 40, b'{"x":"' + b"\xc3\xa9" * 100_000 + b'"}'):
            self.assertSameAsBotocore("POST", RUNTIME + MODEL_PATHS[2], [("content-type", "application/json")], body)

    def test_ports(self):
        """Default ports leave the host alone; others are signed ``host:port`` (IPv6 in brackets)."""
        for base in [
            "http://127.0.0.1:8443",
            "http://127.0.0.1",
            "http://localhost:80",
            "https://bedrock-runtime.us-east-1.amazonaws.com:443",
            "https://bedrock-runtime.us-east-1.amazonaws.com:8443",
            "http://[::1]:9000",
            "https://[::1]",
        ]:
            self.assertSameAsBotocore("POST", base + MODEL_PATHS[0], [("content-type", "application/json")], b"{}")

    def test_session_tokens(self):
        """A session token is sent as ``x-amz-security-token`` and signed."""
        headers = [("content-type", "application/json")]
        self.assertSameAsBotocore("POST", RUNTIME + MODEL_PATHS[6], headers, b"{}", token=TOKEN)
        signed = relay_authorization("POST", RUNTIME, dated(headers, TOKEN), b"{}")
        self.assertIn("SignedHeaders=content-type;host;x-amz-date;x-amz-security-token,", signed)

    def test_dot_segments_and_double_slashes(self):
        """Paths normalized as botocore normalizes them before signing."""
        for path in ["/a//b", "/a/./b/", "/a/b/../c", "/../a", "/a/b/..", "//", "/model/x%20y/invoke", "/caf%C3%A9"]:
            self.assertSameAsBotocore("POST", RUNTIME + path, [], b"")

    def test_method_case(self):
        """The method is signed upper case."""
        headers = dated([])
        self.assertEqual(relay_authorization("post", RUNTIME + "/", headers, b""), relay_authorization("POST", RUNTIME + "/", headers, b""))

    def test_host_header_of_its_own(self):
        """A request carrying its own Host header is signed with that value."""
        self.assertSameAsBotocore("POST", "http://127.0.0.1:9/x", [("Host", "bedrock-runtime.us-east-1.amazonaws.com")], b"")

    def test_fragment_is_never_signed(self):
        """A URL's fragment is not sent, so not signed."""
        headers = dated([])
        self.assertEqual(
            relay_authorization("POST", RUNTIME + "/x?a=1#frag", headers, b""),
            relay_authorization("POST", RUNTIME + "/x?a=1", headers, b""),
        )


class UnsignedHeadersTests(SynchronousTestCase):
    """Headers an HTTP stack may add, duplicate or rewrite are never signed."""

    def test_stack_headers_never_signed(self):
        """
        ``content-length``, ``connection``, ``user-agent``,
        ``transfer-encoding``, ``accept-encoding`` (and botocore's other
        unsigned ones) change nothing in the signature, whatever their values.
        """
        base = dated([("content-type", "application/json")])
        plain = relay_authorization("POST", RUNTIME + MODEL_PATHS[0], base, b"{}")
        noisy = base + [
            ("Content-Length", "2"),
            ("Connection", "close"),
            ("User-Agent", "twisted-relay"),
            ("Transfer-Encoding", "chunked"),
            ("Accept-Encoding", "gzip"),
            ("Expect", "100-continue"),
            ("X-Amzn-Trace-Id", "Root=1-abc"),
            ("traceparent", "00-abc-def-01"),
            ("Authorization", "Bearer stale"),
        ]
        self.assertEqual(relay_authorization("POST", RUNTIME + MODEL_PATHS[0], noisy, b"{}"), plain)
        for name in ("content-length", "connection", "user-agent", "transfer-encoding", "accept-encoding", "authorization"):
            self.assertIn(name.encode(), UNSIGNED)

    def test_signed_headers_named_in_order(self):
        """SignedHeaders lists the lower-case names sorted, host included."""
        headers = dated([("X-Amzn-Bedrock-Accept", "application/json"), ("Content-Type", "application/json")])
        signed = relay_authorization("POST", RUNTIME + MODEL_PATHS[0], headers, b"{}")
        self.assertIn("SignedHeaders=content-type;host;x-amz-date;x-amzn-bedrock-accept,", signed)


class PiecesTests(SynchronousTestCase):
    """The signer's small parts."""

    def test_amz_date(self):
        """x-amz-date is the UTC time to the second."""
        self.assertEqual(amz_date(1796379300.9), "20261204T101500Z")

    def test_wire_host(self):
        """The Host value Twisted's Agent writes: default ports dropped, IPv6 bracketed, lower case."""
        self.assertEqual(wire_host("https", "Bedrock-Runtime.us-east-1.amazonaws.com"), "bedrock-runtime.us-east-1.amazonaws.com")
        self.assertEqual(wire_host("https", "h:443"), "h")
        self.assertEqual(wire_host("http", "h:443"), "h:443")
        self.assertEqual(wire_host("http", "127.0.0.1:80"), "127.0.0.1")
        self.assertEqual(wire_host("http", "[::1]:8080"), "[::1]:8080")
        self.assertEqual(wire_host("https", "[::1]"), "[::1]")

    def test_canonical_query_sorts_encoded_names(self):
        """Pairs sorted by encoded name then value; only unreserved characters left as they are."""
        self.assertEqual(canonical_query("b=2&a=2&a=10&c"), "a=10&a=2&b=2&c=")
        self.assertEqual(canonical_query("a=x%2fy+z"), "a=x%2Fy%2Bz")

    def test_signing_key_kept_per_day_and_secret(self):
        """The day's key is made once, and again when the day or the secret changes."""
        signer = SigV4Signer("bedrock", "us-east-1")
        key = signer.signing_key(SECRET, "20261204")
        self.assertIs(signer.signing_key(SECRET, "20261204"), key)
        self.assertNotEqual(signer.signing_key(SECRET, "20261205"), key)
        self.assertNotEqual(signer.signing_key("other", "20261204"), signer.signing_key(SECRET, "20261204"))

    def test_repr_holds_no_key(self):
        """A signer shows its service and region only, never its kept key."""
        signer = SigV4Signer("bedrock", "us-east-1")
        signer.signing_key(SECRET, "20261204")
        self.assertEqual(repr(signer), "SigV4Signer('bedrock', 'us-east-1')")


#: Characters a model id or a header value may hold.
_ID_CHARS = string.ascii_letters + string.digits + "-._:/~@+ %"
_VALUE_CHARS = string.ascii_letters + string.digits + " \t-._:/,;=+*()\"'"


class GeneratedCasesTests(SynchronousTestCase):
    """The signer and botocore agree on generated requests."""

    @settings(max_examples=300, deadline=None)
    @given(
        model=st.text(_ID_CHARS, min_size=1, max_size=60),
        safe=st.sampled_from([":", "", ":/"]),
        operation=st.sampled_from(["invoke", "invoke-with-response-stream", "count-tokens"]),
        values=st.lists(st.text(_VALUE_CHARS, max_size=30), max_size=3),
        body=st.binary(max_size=200),
        token=st.one_of(st.none(), st.text(string.ascii_letters + string.digits + "/+=", min_size=1, max_size=80)),
        port=st.sampled_from(["", ":443", ":8443"]),
    )
    def test_generated_requests(self, model, safe, operation, values, body, token, port):
        """Any model id quoted as a client would, any header values, any body, port and token: botocore's signature."""
        url = "https://bedrock-runtime.us-west-2.amazonaws.com%s/model/%s/%s" % (port, quote(model, safe=safe), operation)
        headers = [("Content-Type", "application/json")] + [("X-Value-%d" % i, v) for i, v in enumerate(values)]
        headers = dated(headers, token)
        expected = botocore_authorization("POST", url, headers, body, token, region="us-west-2")
        self.assertEqual(relay_authorization("POST", url, headers, body, region="us-west-2"), expected)

    @settings(max_examples=200, deadline=None)
    @given(
        pairs=st.lists(
            st.tuples(st.text(string.ascii_letters + "-_.~", min_size=1, max_size=8), st.text(max_size=12)), max_size=5
        )
    )
    def test_generated_queries(self, pairs):
        """Any names and values, encoded in canonical form: botocore's signature from the URL."""
        query = "&".join("%s=%s" % (quote(k, safe="-_.~"), quote(v, safe="-_.~")) for k, v in pairs)
        url = RUNTIME + "/inference-profiles" + ("?" + query if query else "")
        headers = dated([])
        self.assertEqual(relay_authorization("GET", url, headers, None), botocore_authorization("GET", url, headers, None))
