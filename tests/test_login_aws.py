"""
Tests of the AWS logins (twisted_relay.logins.aws): SigV4 on each request
with the key triple in force, verified the way the Bedrock simulator and AWS
verify it (botocore re-signing the request as a real 127.0.0.1 server
received it from Twisted's client and from the relay's own); credentials from
botocore's real standard chain (temporary shared files, environment, a
container-credentials endpoint served here) refreshed ahead of expiry off
the reactor; static keys from named environment variables; the Bedrock API
key; a one-line start error when botocore is missing.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
import threading
import time

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotocoreCredentials
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.task import Clock, deferLater
from twisted.protocols.policies import WrappingFactory
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import Site

from twisted_relay.logins.aws import (
    AwsKeys,
    AwsSigV4Login,
    BedrockApiKeyLogin,
    aws_login,
    chain_fetch,
    chain_source,
    environment_keys_source,
    require_botocore,
)
from twisted_relay.logins.base import Credentials, CredentialSource, LoginError, LoginThreads
from twisted_relay.redact import is_sensitive_header
from twisted_relay.simulated.bedrock import SimulatedBedrock
from twisted_relay.simulated.bedrock_auth import AwsCredential
from twisted_relay.simulated.resource import SimulatedUpstream
from twisted_relay.upstream import UpstreamClient

from tests.test_logins import InlineThreads

_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
    r"SignedHeaders=([^,]+), Signature=([0-9a-f]{64})$"
)

#: Paths as a Bedrock wire builds them (the model quoted with ``:`` kept, an ARN's ``/`` as ``%2F``).
PATHS = [
    "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke",
    "/model/global.anthropic.claude-opus-4-6-v1/invoke-with-response-stream",
    "/model/anthropic.claude-haiku-4-5-20251001-v1%3A0/count-tokens",
    "/model/arn:aws:bedrock:us-east-1:123456789012:application-inference-profile%2Fhq2of259skzs/invoke",
    "/anthropic/v1/messages?beta=true",
]


def verify_with_botocore(method: bytes, url: str, headers: Headers, body: bytes, secrets: dict) -> list[str]:
    """
    Check a request's SigV4 signature as the Bedrock simulator does:
    botocore signs the request again (as received, at its own
    ``x-amz-date``, with the headers it names) and the signatures must be
    equal. Returns the signed header names; raises AssertionError otherwise.
    """
    match = _AUTHORIZATION.match(headers.getRawHeaders(b"authorization")[0].decode("latin-1"))
    assert match, headers.getRawHeaders(b"authorization")
    access_key_id, _, region, service, signed, signature = match.groups()
    names = signed.split(";")
    request = AWSRequest(method=method.decode(), url=url, data=body)
    for name, values in headers.getAllRawHeaders():
        if name.decode().lower() in names:
            for value in values:
                request.headers[name.decode()] = value.decode("latin-1")
    request.context["timestamp"] = headers.getRawHeaders(b"x-amz-date")[0].decode()
    token = headers.getRawHeaders(b"x-amz-security-token", [b""])[0].decode() or None
    auth = SigV4Auth(BotocoreCredentials(access_key_id, secrets[access_key_id], token), service, region)
    expected = auth.signature(auth.string_to_sign(request, auth.canonical_request(request)), request)
    assert expected == signature, "botocore computes %s, the request carries %s" % (expected, signature)
    return names


def static_source(clock, keys: AwsKeys, expires_at=None) -> CredentialSource:
    return CredentialSource(clock, InlineThreads(), lambda: Credentials(keys, expires_at), "test keys")


ARN_PROFILE = "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/hq2of259skzs"
KEYS = AwsKeys("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session-token-of-test/+=")
SECRETS = {KEYS.access_key_id: KEYS.secret_access_key}


class AwsSigV4LoginTests(SynchronousTestCase):
    """What authorize() puts on a request, on a Clock."""

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1796379300)  # 2026-12-04T10:15:00Z
        self.source = static_source(self.clock, KEYS)
        self.login = AwsSigV4Login(self.clock, self.source, "bedrock", "us-east-1")
        self.successResultOf(self.login.start())

    def signed(self, url="https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[3], body=b"{}", headers=None):
        headers = headers or Headers({b"content-type": [b"application/json"]})
        self.login.authorize(b"POST", url, headers, body)
        return headers

    def test_signs_with_date_token_and_authorization(self):
        """x-amz-date from the reactor's clock, the session token, and a signature botocore verifies."""
        url = "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[3]
        headers = self.signed(url)
        self.assertEqual(headers.getRawHeaders(b"x-amz-date"), [b"20261204T101500Z"])
        self.assertEqual(headers.getRawHeaders(b"x-amz-security-token"), [KEYS.session_token.encode()])
        names = verify_with_botocore(b"POST", url, headers, b"{}", SECRETS)
        self.assertEqual(names, ["content-type", "host", "x-amz-date", "x-amz-security-token"])
        self.assertIn(b"/20261204/us-east-1/bedrock/aws4_request", headers.getRawHeaders(b"authorization")[0])

    def test_signing_again_replaces_every_signature_header(self):
        """
        A retried attempt signed again carries one date, one token and one
        signature, all new (litellm #27513: stale SigV4 headers replayed).
        """
        headers = self.signed()
        self.clock.advance(5)
        self.login.authorize(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[3], headers, b"{}")
        for name in (b"x-amz-date", b"x-amz-security-token", b"authorization"):
            self.assertEqual(len(headers.getRawHeaders(name)), 1, name)
        self.assertEqual(headers.getRawHeaders(b"x-amz-date"), [b"20261204T101505Z"])
        verify_with_botocore(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[3], headers, b"{}", SECRETS)

    def test_client_sent_aws_headers_removed(self):
        """Stale or client-sent authorization, date, token and content hash headers never reach the upstream."""
        source = static_source(self.clock, AwsKeys("AKIDNOTOKEN", "secret-without-token"))
        login = AwsSigV4Login(self.clock, source, "bedrock", "us-east-1")
        self.successResultOf(login.start())
        headers = Headers(
            {
                b"authorization": [b"Bearer relay-key"],
                b"x-amz-security-token": [b"stale"],
                b"x-amz-date": [b"20200101T000000Z"],
                b"x-amz-content-sha256": [b"UNSIGNED-PAYLOAD"],
            }
        )
        login.authorize(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com/x", headers, b"")
        self.assertFalse(headers.hasHeader(b"x-amz-security-token"))
        self.assertFalse(headers.hasHeader(b"x-amz-content-sha256"))
        self.assertEqual(headers.getRawHeaders(b"x-amz-date"), [b"20261204T101500Z"])
        names = verify_with_botocore(
            b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com/x", headers, b"", {"AKIDNOTOKEN": "secret-without-token"}
        )
        self.assertEqual(names, ["host", "x-amz-date"])

    def test_body_hash_given(self):
        """A body hash computed beforehand is the one signed: right, it verifies; wrong, it does not."""
        url = "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[0]
        body = b'{"max_tokens":16}'
        headers = Headers()
        self.login.authorize(b"POST", url, headers, body, body_sha256=hashlib.sha256(body).hexdigest())
        verify_with_botocore(b"POST", url, headers, body, SECRETS)
        headers = Headers()
        self.login.authorize(b"POST", url, headers, body, body_sha256=hashlib.sha256(b"other").hexdigest())
        self.assertRaises(AssertionError, verify_with_botocore, b"POST", url, headers, body, SECRETS)

    def test_not_started_is_a_login_error(self):
        """Signing before the first fetch is a LoginError naming the source, not a crash."""
        login = AwsSigV4Login(self.clock, static_source(self.clock, KEYS), "bedrock", "us-east-1")
        error = self.assertRaises(LoginError, login.authorize, b"POST", "https://h/x", Headers(), b"")
        self.assertEqual(str(error), "test keys: none fetched yet")

    def test_refresh_signs_with_the_whole_new_triple(self):
        """After a refresh every signature uses the new key id, secret and token together."""
        issued = iter([KEYS, AwsKeys("AKIDSECOND", "second-secret", None)])
        source = CredentialSource(self.clock, InlineThreads(), lambda: Credentials(next(issued)), "test keys")
        login = AwsSigV4Login(self.clock, source, "bedrock", "us-east-1")
        self.successResultOf(login.start())
        url = "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[0]
        first = Headers()
        login.authorize(b"POST", url, first, b"{}")
        self.successResultOf(login.refresh())
        second = Headers()
        login.authorize(b"POST", url, second, b"{}")
        self.assertTrue(second.getRawHeaders(b"authorization")[0].startswith(b"AWS4-HMAC-SHA256 Credential=AKIDSECOND/"))
        self.assertFalse(second.hasHeader(b"x-amz-security-token"))
        verify_with_botocore(b"POST", url, first, b"{}", SECRETS)
        verify_with_botocore(b"POST", url, second, b"{}", {"AKIDSECOND": "second-secret"})

    def test_each_service_name(self):
        """Bedrock, Bedrock Mantle and Claude Platform on AWS sign with their own names; others are refused."""
        for service in ("bedrock", "bedrock-mantle", "aws-external-anthropic"):
            login = AwsSigV4Login(self.clock, self.source, service, "eu-west-1")
            headers = Headers()
            login.authorize(b"POST", "https://%s.eu-west-1.api.aws/v1/messages" % (service,), headers, b"{}")
            self.assertIn(b"/eu-west-1/%s/aws4_request" % (service.encode(),), headers.getRawHeaders(b"authorization")[0])
        self.assertRaises(LoginError, AwsSigV4Login, self.clock, self.source, "bedrock-runtime", "us-east-1")
        self.assertRaises(LoginError, AwsSigV4Login, self.clock, self.source, "bedrock", "")

    def test_secret_headers_are_redacted_in_dumps(self):
        """The headers that carry a secret are ones the relay's dumps and logs redact by name."""
        headers = self.signed()
        for name, _ in headers.getAllRawHeaders():
            self.assertEqual(is_sensitive_header(name), name.lower() in (b"authorization", b"x-amz-security-token"), name)

    def test_no_secret_in_reprs(self):
        """Keys, credentials, the login and its source show no secret."""
        shown = " ".join(repr(x) for x in (KEYS, self.source.current, self.login, self.source))
        for secret in (KEYS.secret_access_key, KEYS.session_token):
            self.assertNotIn(secret, shown)
        self.assertNotIn("AKIDEXAMPLE", repr(KEYS))


class ExpiryMidRunTests(SynchronousTestCase):
    """Credentials that expire while the relay runs: refreshed before, so no request signs with expired ones."""

    def run_for(self, hours: float, failures_per_refresh: int = 0):
        clock = Clock()
        clock.advance(1_800_000_000)
        issued: dict[str, str] = {}
        attempts = []
        failing = [0]

        def fetch():
            attempts.append(clock.seconds())
            if failing[0]:
                failing[0] -= 1
                raise OSError("STS is unreachable")
            failing[0] = failures_per_refresh
            number = len(issued) + 1
            keys = AwsKeys("ASIAMINTED%04d" % (number,), "minted-secret-%d" % (number,), "minted-token-%d" % (number,))
            issued[keys.access_key_id] = keys.secret_access_key
            return Credentials(keys, clock.seconds() + 3600)

        source = CredentialSource(clock, InlineThreads(), fetch, "minted keys", margin=600)
        login = AwsSigV4Login(clock, source, "bedrock", "us-west-2")
        self.successResultOf(login.start())
        url = "https://bedrock-runtime.us-west-2.amazonaws.com" + PATHS[1]
        used = []
        for _ in range(int(hours * 3600 / 10)):
            clock.advance(10)
            headers = Headers({b"content-type": [b"application/json"]})
            login.authorize(b"POST", url, headers, b'{"max_tokens":1}')
            verify_with_botocore(b"POST", url, headers, b'{"max_tokens":1}', issued)
            access_key_id = _AUTHORIZATION.match(headers.getRawHeaders(b"authorization")[0].decode()).group(1)
            self.assertEqual(access_key_id, source.current.value.access_key_id)
            left = source.current.expires_at - clock.seconds()
            self.assertGreater(left, 0, "signed with expired credentials")
            used.append(access_key_id)
        return used, attempts

    def test_hourly_credentials_over_four_hours(self):
        """Four hours of requests every 10 s: five triples used in turn, each replaced 600 s before it expires."""
        used, attempts = self.run_for(4)
        self.assertEqual(sorted(set(used)), ["ASIAMINTED%04d" % (n,) for n in range(1, 6)])
        self.assertEqual([a - attempts[0] for a in attempts], [0, 3000, 6000, 9000, 12000])

    def test_refresh_failing_twice_still_in_time(self):
        """Each refresh fails twice before it works: the old triple (still valid) signs meanwhile, none expired."""
        used, attempts = self.run_for(3, failures_per_refresh=2)
        self.assertEqual(len(set(used)), 4)
        self.assertEqual([a - attempts[0] for a in attempts[:4]], [0, 3000, 3010, 3020])


class BedrockApiKeyLoginTests(SynchronousTestCase):
    """A Bedrock API key as a bearer token."""

    def test_bearer(self):
        """The key goes in Authorization: Bearer, replacing the client's, and no SigV4 header goes."""
        login = BedrockApiKeyLogin("bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t")
        headers = Headers({b"authorization": [b"Bearer relay-key"], b"x-amz-date": [b"stale"]})
        login.authorize(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com/x", headers, b"{}")
        self.assertEqual(headers.getRawHeaders(b"authorization"), [b"Bearer bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t"])
        self.assertFalse(headers.hasHeader(b"x-amz-date"))
        self.assertNotIn("YmVkcm9j", repr(login))

    def test_from_environment(self):
        """The key read from a named variable; a missing variable is named, a bad value is not shown."""
        name = "TWISTED_RELAY_TEST_BEDROCK_KEY"
        self.addCleanup(os.environ.pop, name, None)
        error = self.assertRaises(LoginError, BedrockApiKeyLogin.from_environment, name)
        self.assertEqual(str(error), "the environment variable %s is not set" % (name,))
        os.environ[name] = "secret-part\nsecond-line"
        error = self.assertRaises(LoginError, BedrockApiKeyLogin.from_environment, name)
        self.assertNotIn("secret-part", str(error))
        self.assertIn(name, str(error))
        os.environ[name] = "  the-key  "
        headers = Headers()
        BedrockApiKeyLogin.from_environment(name).authorize(b"POST", "https://h/x", headers, None)
        self.assertEqual(headers.getRawHeaders(b"authorization"), [b"Bearer the-key"])


class AwsLoginSettingsTests(SynchronousTestCase):
    """aws_login: the source an upstream's settings name, and one-line errors for those that cannot work."""

    def setUp(self):
        self.clock = Clock()
        self.threads = InlineThreads()

    def test_key_variables_or_the_chain(self):
        """Both key variables named: keys from them; none: the chain (a profile, else the default)."""
        login = aws_login(self.clock, self.threads, "us-east-1", "bedrock", None, "TR_AKID", "TR_SECRET", "TR_TOKEN")
        self.assertIn("AWS keys from $TR_AKID, $TR_SECRET, $TR_TOKEN", repr(login))
        login = aws_login(self.clock, self.threads, "eu-west-1", "bedrock-mantle", "work")
        self.assertEqual(
            repr(login), "AwsSigV4Login('bedrock-mantle', 'eu-west-1', AWS credentials from the standard chain (profile work))"
        )
        login = aws_login(self.clock, self.threads, "us-west-2", "aws-external-anthropic")
        self.assertIn("(the default profile)", repr(login))

    def test_settings_that_cannot_work(self):
        """Each refused in one line that says why."""
        cases = [
            ((None,), "an AWS login needs a region"),
            (("us-east-1", "bedrock-runtime"), "unknown AWS signing name 'bedrock-runtime'"),
            (("us-east-1", "bedrock", None, "TR_AKID"), "need both the access key id's and the secret's variable"),
            (("us-east-1", "bedrock", None, None, "TR_SECRET"), "need both the access key id's and the secret's variable"),
            (("us-east-1", "bedrock", "work", "TR_AKID", "TR_SECRET"), "either a profile or key variables, not both"),
            (("us-east-1", "bedrock", None, None, None, "TR_TOKEN"), "a session token's variable needs"),
        ]
        for arguments, words in cases:
            error = self.assertRaises(LoginError, aws_login, self.clock, self.threads, *arguments)
            self.assertIn(words, str(error))
            self.assertNotIn("\n", str(error))


class BlockedImport:
    """Makes ``import botocore`` fail for one test, as where it is not installed."""

    def __init__(self, testcase, *names):
        for name in names:
            saved = sys.modules.get(name)
            sys.modules[name] = None  # the import system's own "not here"
            testcase.addCleanup(self._restore, name, saved)

    @staticmethod
    def _restore(name, saved):
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


class WithoutBotocoreTests(SynchronousTestCase):
    """Without botocore: a one-line start error for the chain; static keys and the signer still work."""

    def setUp(self):
        BlockedImport(self, "botocore", "botocore.session")

    def test_chain_needs_botocore(self):
        """The chain without botocore: a LoginError that says what to install."""
        error = self.assertRaises(LoginError, require_botocore)
        self.assertEqual(
            str(error), "AWS credentials from the standard chain need botocore: pip install 'twisted-relay[aws]'"
        )
        self.assertRaises(LoginError, chain_source, Clock(), InlineThreads())
        self.assertRaises(LoginError, aws_login, Clock(), InlineThreads(), "us-east-1")

    def test_environment_keys_need_no_botocore(self):
        """Keys from named environment variables sign without botocore."""
        self.addCleanup(os.environ.pop, "TR_TEST_AKID", None)
        self.addCleanup(os.environ.pop, "TR_TEST_SECRET", None)
        os.environ.update(TR_TEST_AKID="AKIDFROMENV", TR_TEST_SECRET="secret-from-env")
        clock = Clock()
        source = environment_keys_source(clock, InlineThreads(), "TR_TEST_AKID", "TR_TEST_SECRET")
        login = AwsSigV4Login(clock, source, "bedrock", "us-east-1")
        self.successResultOf(login.start())
        headers = Headers()
        login.authorize(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com/x", headers, b"")
        self.assertTrue(headers.getRawHeaders(b"authorization")[0].startswith(b"AWS4-HMAC-SHA256 Credential=AKIDFROMENV/"))
        self.assertIsNone(source.current.expires_at)
        login = aws_login(clock, InlineThreads(), "us-east-1", "bedrock", None, "TR_TEST_AKID", "TR_TEST_SECRET")
        self.successResultOf(login.start())

    def test_environment_keys_missing(self):
        """A named variable that is not set: the error names it (and shows no value)."""
        self.addCleanup(os.environ.pop, "TR_TEST_AKID", None)
        os.environ["TR_TEST_AKID"] = "AKIDFROMENV"
        source = environment_keys_source(Clock(), InlineThreads(), "TR_TEST_AKID", "TR_TEST_NO_SUCH_SECRET", "TR_TEST_TOKEN")
        failure = self.failureResultOf(source.start(), LoginError)
        self.assertEqual(
            str(failure.value),
            "AWS keys from $TR_TEST_AKID, $TR_TEST_NO_SUCH_SECRET, $TR_TEST_TOKEN: "
            "the environment variable TR_TEST_NO_SUCH_SECRET is not set",
        )


def isolated_aws_environment(testcase, **values) -> str:
    """
    No AWS variable of this machine's, no shared file of its own, no
    instance metadata (never a request off loopback); then ``values``.
    Returns a folder for the test's shared files.
    """
    saved = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    folder = os.path.abspath(testcase.mktemp())
    os.makedirs(folder)

    def restore():
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            del os.environ[name]
        os.environ.update(saved)

    testcase.addCleanup(restore)
    for name in saved:
        del os.environ[name]
    os.environ.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_SHARED_CREDENTIALS_FILE=os.path.join(folder, "credentials"),
        AWS_CONFIG_FILE=os.path.join(folder, "config"),
    )
    os.environ.update(values)
    return folder


class ContainerEndpoint(Resource):
    """
    An ECS/EKS container-credentials endpoint: each GET mints new
    short-lived credentials with their ``Expiration``; the authorization
    token must match.
    """

    isLeaf = True

    def __init__(self, token: str, life: float = 3600.0):
        super().__init__()
        self.token = token
        self.life = life
        self.minted: list[dict] = []
        self.status = 200
        self.error_body = b""

    def render_GET(self, request):
        if self.status != 200:
            request.setResponseCode(self.status)
            return self.error_body
        if request.getHeader(b"authorization") != self.token.encode():
            request.setResponseCode(401)
            return b'{"message":"no"}'
        number = len(self.minted) + 1
        expiration = datetime.datetime.fromtimestamp(time.time() + self.life, datetime.timezone.utc)
        minted = {
            "AccessKeyId": "ASIACONTAINER%04d" % (number,),
            "SecretAccessKey": "container-secret-%d" % (number,),
            "Token": "container-session-token-%d" % (number,),
            "Expiration": expiration.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        self.minted.append(minted)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(minted).encode()


async def wait_for(condition, timeout=10.0, step=0.02):
    """Wait on the reactor until ``condition()`` holds; fail after ``timeout``."""
    waited = 0.0
    while not condition():
        if waited >= timeout:
            raise AssertionError("condition not met within %s s" % (timeout,))
        await deferLater(reactor, step, lambda: None)
        waited += step


def serve(testcase, resource) -> int:
    """
    Serve ``resource`` on 127.0.0.1; at the test's end, close what clients
    left open (botocore's HTTP pool keeps its connections). Returns the port.
    """
    connections = WrappingFactory(Site(resource))
    port = reactor.listenTCP(0, connections, interface="127.0.0.1")

    async def close():
        await port.stopListening()
        for protocol in list(connections.protocols):
            protocol.transport.loseConnection()
        await wait_for(lambda: not connections.protocols)

    testcase.addCleanup(close)
    return port.getHost().port


class StandardChainTests(TestCase):
    """botocore's real chain, on files, variables and an endpoint made here; every fetch on the login threads."""

    def setUp(self):
        self.threads = LoginThreads(reactor)
        self.addCleanup(self.threads.stop)

    def serve_container(self, life: float = 3600.0) -> ContainerEndpoint:
        endpoint = ContainerEndpoint("container-authorization-token", life)
        port = serve(self, endpoint)
        isolated_aws_environment(
            self,
            AWS_CONTAINER_CREDENTIALS_FULL_URI="http://127.0.0.1:%d/v2/credentials/role" % (port,),
            AWS_CONTAINER_AUTHORIZATION_TOKEN="container-authorization-token",
        )
        return endpoint

    async def test_shared_credentials_file_and_profile(self):
        """The named profile's keys from the shared credentials file; they never expire."""
        folder = isolated_aws_environment(self)
        with open(os.path.join(folder, "credentials"), "w") as f:
            f.write(
                "[default]\naws_access_key_id = AKIDDEFAULT\naws_secret_access_key = default-secret\n\n"
                "[work]\naws_access_key_id = AKIDWORK\naws_secret_access_key = work-secret\n"
                "aws_session_token = work-token\n"
            )
        for profile, expected in [(None, ("AKIDDEFAULT", "default-secret", None)), ("work", ("AKIDWORK", "work-secret", "work-token"))]:
            source = chain_source(reactor, self.threads, profile)
            await source.start()
            keys = source.current.value
            self.assertEqual((keys.access_key_id, keys.secret_access_key, keys.session_token), expected)
            self.assertIsNone(source.current.expires_at)

    async def test_environment_first(self):
        """Keys in the environment come before the shared files (the chain's order)."""
        folder = isolated_aws_environment(
            self, AWS_ACCESS_KEY_ID="AKIDENV", AWS_SECRET_ACCESS_KEY="env-secret", AWS_SESSION_TOKEN="env-token"
        )
        with open(os.path.join(folder, "credentials"), "w") as f:
            f.write("[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = file-secret\n")
        source = chain_source(reactor, self.threads)
        await source.start()
        self.assertEqual(source.current.value.access_key_id, "AKIDENV")
        self.assertEqual(source.current.value.session_token, "env-token")

    async def test_expiry_read_from_botocore(self):
        """Credentials with an expiry (here AWS_CREDENTIAL_EXPIRATION) are kept with it, to the second."""
        expiration = int(time.time()) + 7200
        isolated_aws_environment(
            self,
            AWS_ACCESS_KEY_ID="AKIDEXPIRING",
            AWS_SECRET_ACCESS_KEY="expiring-secret",
            AWS_SESSION_TOKEN="expiring-token",
            AWS_CREDENTIAL_EXPIRATION=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expiration)),
        )
        source = chain_source(reactor, self.threads)
        self.addCleanup(source.stop)
        await source.start()
        self.assertEqual(source.current.value.access_key_id, "AKIDEXPIRING")
        self.assertLessEqual(abs(source.current.expires_at - expiration), 1.0)

    async def test_container_credentials_refreshed_before_expiry(self):
        """
        Short-lived credentials from a container endpoint, with their
        expiry: fetched off the reactor thread, kept, and fetched again
        through botocore 600 s before they expire (the source's clock moved
        on); the requests signed after carry the new triple.
        """
        await self.check_container_refresh(life=3600, calls_per_fetch=1)

    async def test_container_credentials_inside_botocores_window(self):
        """
        Credentials living 12 minutes, inside botocore's own 15-minute
        refresh window: botocore fetches them twice per fetch (its advisory
        refresh), and the source still moves to new ones 600 s before expiry.
        """
        await self.check_container_refresh(life=720, calls_per_fetch=2)

    async def check_container_refresh(self, life: float, calls_per_fetch: int):
        endpoint = self.serve_container(life=life)
        clock = Clock()
        clock.advance(time.time())
        reactor_thread = threading.get_ident()
        fetch_threads = []
        fetch = chain_fetch()

        def recorded():
            fetch_threads.append(threading.get_ident())
            return fetch()

        source = CredentialSource(clock, self.threads, recorded, "AWS container credentials", margin=600)
        login = AwsSigV4Login(clock, source, "bedrock", "us-east-1")
        await login.start()
        first = source.current
        n = calls_per_fetch
        self.assertEqual(first.value.access_key_id, "ASIACONTAINER%04d" % (n,))
        self.assertEqual(first.value.session_token, "container-session-token-%d" % (n,))
        expiration = datetime.datetime.strptime(endpoint.minted[n - 1]["Expiration"], "%Y-%m-%dT%H:%M:%SZ")
        expiration = expiration.replace(tzinfo=datetime.timezone.utc).timestamp()
        self.assertLessEqual(abs(first.expires_at - expiration), 1.0)

        clock.advance(first.expires_at - clock.seconds() - 601)
        self.assertEqual(len(endpoint.minted), n)
        clock.advance(2)
        await wait_for(lambda: source.current is not first)
        self.assertEqual(source.current.value.access_key_id, "ASIACONTAINER%04d" % (2 * n,))
        self.assertEqual(len(endpoint.minted), 2 * n)
        self.assertEqual(len(fetch_threads), 2)
        self.assertNotIn(reactor_thread, fetch_threads)

        headers = Headers()
        login.authorize(b"POST", "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[0], headers, b"{}")
        verify_with_botocore(
            b"POST",
            "https://bedrock-runtime.us-east-1.amazonaws.com" + PATHS[0],
            headers,
            b"{}",
            {"ASIACONTAINER%04d" % (2 * n,): "container-secret-%d" % (2 * n,)},
        )
        self.assertEqual(headers.getRawHeaders(b"x-amz-security-token"), [b"container-session-token-%d" % (2 * n,)])

    async def test_no_credentials_anywhere(self):
        """Nothing in the chain: one line saying where it looked."""
        isolated_aws_environment(self)
        source = chain_source(reactor, self.threads)
        with self.assertRaises(LoginError) as raised:
            await source.start()
        self.assertEqual(
            str(raised.exception),
            "AWS credentials from the standard chain (the default profile): no credentials found "
            "(environment, shared files, SSO, web identity, container or instance metadata)",
        )

    async def test_errors_are_one_line_and_show_no_secret(self):
        """A missing profile, partial keys, an endpoint's multi-line error: one line each, no secret in any."""
        isolated_aws_environment(self, AWS_ACCESS_KEY_ID="AKIDPARTIAL", AWS_SESSION_TOKEN="partial-session-token")
        source = chain_source(reactor, self.threads)
        with self.assertRaises(LoginError) as raised:
            await source.start()
        message = str(raised.exception)
        self.assertIn("PartialCredentialsError", message)
        self.assertNotIn("partial-session-token", message)

        source = chain_source(reactor, self.threads, "no-such-profile")
        with self.assertRaises(LoginError) as raised:
            await source.start()
        self.assertIn("ProfileNotFound", str(raised.exception))
        self.assertIn("no-such-profile", str(raised.exception))

        endpoint = self.serve_container()
        endpoint.status = 500
        endpoint.error_body = b"internal error\nsee logs\r\nrequest 42"
        source = chain_source(reactor, self.threads)
        with self.assertRaises(LoginError) as raised:
            await source.start()
        message = str(raised.exception)
        self.assertIn("500", message)
        self.assertNotIn("\n", message)
        self.assertNotIn("container-authorization-token", message)


class Recorder(Resource):
    """An upstream on 127.0.0.1 that keeps each request as it arrived."""

    isLeaf = True

    def __init__(self):
        super().__init__()
        self.received: list[tuple] = []

    def render(self, request):
        host = request.getHeader(b"host").decode()
        self.received.append(
            (request.method, "http://%s%s" % (host, request.uri.decode()), request.requestHeaders.copy(), request.content.read())
        )
        return b"{}"


class OnTheWireTests(TestCase):
    """
    The relay's signed requests as Twisted sends them, received by a real
    server on 127.0.0.1 (at a port that is not the default) and verified by
    botocore re-signing them: nothing the HTTP stack adds or rewrites breaks
    a signature.
    """

    def setUp(self):
        self.recorder = Recorder()
        self.base = "http://127.0.0.1:%d" % (serve(self, self.recorder),)
        self.clock = Clock()
        self.clock.advance(time.time())
        self.login = AwsSigV4Login(self.clock, static_source(self.clock, KEYS), "bedrock", "us-east-1")
        self.successResultOf(self.login.start())

    def request_headers(self) -> Headers:
        return Headers(
            {
                b"content-type": [b"application/json"],
                b"anthropic-version": [b"2023-06-01"],
                b"x-amzn-bedrock-accept": [b"application/json"],
                b"user-agent": [b"claude-cli/2.1 (external, cli)"],
                b"x-custom": [b"  inner   spaces\tand tab "],
                # treq sets its own, the relay's agent removes it: signed, it would break the signature.
                b"accept-encoding": [b"gzip"],
            }
        )

    def check_received(self, sent):
        self.assertEqual(len(self.recorder.received), len(sent))
        for (method, url, headers, body), (path, sent_body) in zip(self.recorder.received, sent):
            self.assertEqual(url, self.base + path)
            self.assertEqual(body, sent_body)
            names = verify_with_botocore(method, url, headers, body, SECRETS)
            self.assertIn("host", names)
            for never in ("content-length", "connection", "user-agent", "accept-encoding", "transfer-encoding"):
                self.assertNotIn(never, names)

    async def test_through_the_relays_upstream_client(self):
        """The relay's own UpstreamClient (treq over PooledAgent), the URL signed as wire_url() gives it."""
        client = UpstreamClient(reactor, self.base)
        self.addCleanup(client.close)
        sent = []
        for number, path in enumerate(PATHS):
            body = b'{"max_tokens":16,"n":%d,"text":"caf\xc3\xa9"}' % (number,)
            headers = self.request_headers()
            self.login.authorize(b"POST", client.wire_url(path), headers, body)
            response = await client.request(b"POST", path, headers, body)
            await readBody(response)
            sent.append((path, body))
        self.check_received(sent)

    async def test_through_twisteds_agent(self):
        """Plain treq over Twisted's Agent (which adds its own Host and Connection headers)."""
        client = HTTPClient(Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False)))
        sent = []
        for path, body in [(PATHS[3], b"{}"), (PATHS[1], b""), (PATHS[4], b"x" * 70000)]:
            headers = self.request_headers()
            self.login.authorize(b"POST", self.base + path, headers, body)
            response = await client.request("POST", self.base + path, headers=headers, data=body)
            await response.content()
            sent.append((path, body))
        self.check_received(sent)

    async def test_header_sent_twice(self):
        """
        A content-type sent twice (litellm #13738) goes out as two lines,
        which AWS joins with a comma, as the signature does.
        """
        client = UpstreamClient(reactor, self.base)
        self.addCleanup(client.close)
        headers = self.request_headers()
        headers.addRawHeader(b"content-type", b"application/json")
        self.login.authorize(b"POST", client.wire_url(PATHS[0]), headers, b"{}")
        await readBody(await client.request(b"POST", PATHS[0], headers, b"{}"))
        received = self.recorder.received[0][2]
        self.assertEqual(received.getRawHeaders(b"content-type"), [b"application/json", b"application/json"])
        self.check_received([(PATHS[0], b"{}")])

    async def test_changed_byte_fails(self):
        """The check itself: a body changed by one byte after signing does not verify."""
        client = UpstreamClient(reactor, self.base)
        self.addCleanup(client.close)
        headers = self.request_headers()
        self.login.authorize(b"POST", client.wire_url(PATHS[0]), headers, b'{"a":1}')
        await readBody(await client.request(b"POST", PATHS[0], headers, b'{"a":2}'))
        method, url, received, body = self.recorder.received[0]
        self.assertRaises(AssertionError, verify_with_botocore, method, url, received, body, SECRETS)


class AgainstSimulatedBedrockTests(TestCase):
    """
    The logins against the simulated Bedrock (which checks a signature as
    AWS does, by botocore signing the request again), over 127.0.0.1 through
    the relay's own UpstreamClient, the URL signed as ``wire_url`` gives it.
    """

    def setUp(self):
        self.clock = Clock()
        self.clock.advance(time.time())
        self.sim = SimulatedBedrock(
            SimulatedUpstream(thinking_secret="bedrock-login-test"),
            access_keys={
                "ASIASIMLOGIN": AwsCredential("sim-temporary-secret", "sim-session-token", time.time() + 3600),
                "ASIASIMEXPIRED": AwsCredential("sim-expired-secret", "sim-expired-token", time.time() - 1),
            },
            api_keys={"bedrock-api-key-sim-login": "123456789012"},
            application_profiles={ARN_PROFILE: "us.anthropic.claude-haiku-4-5-20251001-v1:0"},
        )
        self.client = UpstreamClient(reactor, "http://127.0.0.1:%d" % (serve(self, self.sim.resource()),))
        self.addCleanup(self.client.close)

    async def invoke(self, login, model_path: str):
        path = "/model/%s/invoke" % (model_path,)
        body = json.dumps(
            {"anthropic_version": "bedrock-2023-05-31", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
        ).encode()
        headers = Headers({b"content-type": [b"application/json"], b"accept": [b"application/json"]})
        login.authorize(b"POST", self.client.wire_url(path), headers, body)
        response = await self.client.request(b"POST", path, headers, body)
        return response.code, json.loads(await readBody(response)), response

    def sigv4(self, keys: AwsKeys) -> AwsSigV4Login:
        login = AwsSigV4Login(self.clock, static_source(self.clock, keys), "bedrock", "us-east-1")
        self.successResultOf(login.start())
        return login

    async def test_sigv4_accepted_for_every_model_form(self):
        """A system profile with ``:0``, a global profile, an application profile ARN (``%2F``): each accepted."""
        login = self.sigv4(AwsKeys("ASIASIMLOGIN", "sim-temporary-secret", "sim-session-token"))
        for model_path in (
            "us.anthropic.claude-haiku-4-5-20251001-v1:0",
            "global.anthropic.claude-opus-4-6-v1",
            ARN_PROFILE.replace("/", "%2F"),
        ):
            code, answer, _ = await self.invoke(login, model_path)
            self.assertEqual(code, 200, (model_path, answer))
            self.assertTrue(answer["id"].startswith("msg_bdrk_"), answer)

    async def test_expired_and_wrong_keys_refused_as_aws_does(self):
        """Expired credentials: 403 ExpiredTokenException (what makes the relay fetch again); a wrong secret: a signature mismatch."""
        code, answer, response = await self.invoke(
            self.sigv4(AwsKeys("ASIASIMEXPIRED", "sim-expired-secret", "sim-expired-token")), "global.anthropic.claude-opus-4-6-v1"
        )
        self.assertEqual(code, 403)
        self.assertEqual(response.headers.getRawHeaders(b"x-amzn-errortype")[0].split(b":")[0], b"ExpiredTokenException")
        code, answer, response = await self.invoke(
            self.sigv4(AwsKeys("ASIASIMLOGIN", "not-the-secret", "sim-session-token")), "global.anthropic.claude-opus-4-6-v1"
        )
        self.assertEqual(code, 403)
        self.assertEqual(response.headers.getRawHeaders(b"x-amzn-errortype")[0].split(b":")[0], b"InvalidSignatureException")

    async def test_api_key(self):
        """The Bedrock API key as a bearer token is accepted."""
        code, answer, _ = await self.invoke(BedrockApiKeyLogin("bedrock-api-key-sim-login"), "global.anthropic.claude-opus-4-6-v1")
        self.assertEqual(code, 200, answer)
