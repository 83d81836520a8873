# -*- test-case-name: tests.test_simulated_bedrock -*-
"""
Who may call the simulated Bedrock: AWS Signature Version 4 checked by
signing the request again with botocore, at the request's own
``X-Amz-Date``, or a Bedrock API key as ``Authorization: Bearer``.

The checks and their answers, in AWS's words (all 403):

- no ``Authorization``: ``MissingAuthenticationTokenException``
  ("Authorization header is missing");
- an access key not in the table, or a temporary one without its session
  token: ``UnrecognizedClientException`` ("The security token included in
  the request is invalid.");
- a session token past its expiry: ``ExpiredTokenException``;
- a credential scoped to another service or region, a date more than five
  minutes off, or a signature that differs (one changed byte of the body,
  a header signed but changed or duplicated on the way, the path encoded
  otherwise): ``InvalidSignatureException``;
- an unknown Bedrock API key: ``AccessDeniedException``-style 403
  ("Authentication failed: Please make sure your API Key is valid.").

Secrets never appear in an error.  Pure: no Twisted (botocore is needed,
the ``[aws]`` extra).
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Callable

from twisted_relay.simulated.bedrock_rules import BedrockError

__all__ = ["AwsCredential", "BedrockAuth", "MAX_SKEW", "SIGNATURE_MISMATCH"]

#: How far ``X-Amz-Date`` may be from the simulator's clock, in seconds.
MAX_SKEW = 300.0

#: AWS's message for a signature that does not match.
SIGNATURE_MISMATCH = (
    "The request signature we calculated does not match the signature you provided. Check your AWS Secret "
    "Access Key and signing method. Consult the service documentation for details."
)

_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
    r"SignedHeaders=([^,\s]+),\s*Signature=([0-9a-f]{64})$"
)
_AMZ_DATE = "%Y%m%dT%H%M%SZ"


@dataclass
class AwsCredential:
    """
    An access key's secret, and for temporary credentials their session
    token and when they expire (seconds since the epoch; ``None``: never).
    """

    secret_key: str
    session_token: str | None = None
    expires_at: float | None = None
    account: str = "123456789012"

    def __repr__(self) -> str:
        # The secret and the token stay out of logs and test output.
        return f"AwsCredential(account={self.account!r}, expires_at={self.expires_at!r})"


def _forbidden(error_type: str, message: str, key: str = "message") -> BedrockError:
    return BedrockError(403, error_type, message, key=key)


def _amz_time(stamp: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(stamp, _AMZ_DATE)))
    except ValueError:
        return None


def _stamp(seconds: float) -> str:
    return time.strftime(_AMZ_DATE, time.gmtime(seconds))


class BedrockAuth:
    """
    The simulated Bedrock's table of credentials, and the check of one request.

    :param region: the region the simulator serves; a signature must be
        scoped to it and to the service ``bedrock``.
    :param access_keys: access key id -> :class:`AwsCredential` (or just its
        secret key); a live table (tests add keys and move expiries).
    :param api_keys: Bedrock API key -> account.
    :param wall_clock: the time signatures and expiries are judged by.
    """

    def __init__(self, region: str, access_keys: dict | None = None, api_keys: dict[str, str] | None = None,
                 wall_clock: Callable[[], float] = time.time, max_skew: float = MAX_SKEW):
        self.region = region
        self.access_keys: dict[str, AwsCredential] = {}
        for access_key, credential in (access_keys or {}).items():
            self.add_access_key(access_key, credential)
        self.api_keys: dict[str, str] = dict(api_keys or {})
        self.wall_clock = wall_clock
        self.max_skew = max_skew

    def add_access_key(self, access_key: str, credential: AwsCredential | str) -> None:
        """Accept ``access_key`` (with its credential, or just its secret)."""
        if isinstance(credential, str):
            credential = AwsCredential(credential)
        self.access_keys[access_key] = credential

    def check(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> str:
        """
        Check one request as received; return its AWS account.

        :param url: ``http://{host}{path and query as sent}``.
        :param headers: every header as received, repeats kept, in order.
        :raises BedrockError: 403 as Bedrock answers it.
        """
        authorization = [value for name, value in headers if name.lower() == "authorization"]
        if not authorization:
            raise _forbidden("MissingAuthenticationTokenException", "Authorization header is missing", "Message")
        value = authorization[0].strip()
        if value[:7].lower() == "bearer ":
            return self._bearer(value[7:].strip())
        return self._sigv4(method, url, headers, body, value)

    def _bearer(self, key: str) -> str:
        for known, account in self.api_keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return account
        raise _forbidden("AccessDeniedException", "Authentication failed: Please make sure your API Key is valid.",
                         "Message")

    def _sigv4(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, authorization: str) -> str:
        match = _AUTHORIZATION.match(authorization)
        if match is None:
            raise _forbidden("IncompleteSignatureException",
                             "Authorization header requires 'Credential', 'Signature' and 'SignedHeaders' "
                             "parameters.")
        access_key, _, region, service, signed, signature = match.groups()
        credential = self.access_keys.get(access_key)
        token = _first(headers, "x-amz-security-token")
        if credential is None or (credential.session_token is not None and not (
                token is not None and hmac.compare_digest(token.encode(), credential.session_token.encode()))):
            raise _forbidden("UnrecognizedClientException", "The security token included in the request is invalid.")
        now = self.wall_clock()
        if credential.expires_at is not None and now >= credential.expires_at:
            raise _forbidden("ExpiredTokenException", "The security token included in the request is expired")
        if service != "bedrock":
            raise _forbidden("InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'. ")
        if region != self.region:
            raise _forbidden("InvalidSignatureException",
                             f"Credential should be scoped to a valid region, not '{region}'. ")
        stamp = _first(headers, "x-amz-date") or ""
        signed_at = _amz_time(stamp)
        if signed_at is None:
            raise _forbidden("IncompleteSignatureException",
                             "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header.")
        if signed_at < now - self.max_skew:
            raise _forbidden("InvalidSignatureException",
                             f"Signature expired: {stamp} is now earlier than {_stamp(now - self.max_skew)} "
                             f"({_stamp(now)} - 5 min.)")
        if signed_at > now + self.max_skew:
            raise _forbidden("InvalidSignatureException",
                             f"Signature not yet current: {stamp} is still later than {_stamp(now + self.max_skew)} "
                             f"({_stamp(now)} + 5 min.)")
        content_hash = _first(headers, "x-amz-content-sha256")
        if content_hash is not None and content_hash != hashlib.sha256(body).hexdigest():
            raise _forbidden("InvalidSignatureException", SIGNATURE_MISMATCH)
        expected = _signature(method, url, headers, body, signed.split(";"), stamp, access_key, credential, region)
        if not hmac.compare_digest(expected, signature):
            raise _forbidden("InvalidSignatureException", SIGNATURE_MISMATCH)
        return credential.account


def _first(headers: list[tuple[str, str]], name: str) -> str | None:
    for header, value in headers:
        if header.lower() == name:
            return value
    return None


def _signature(method: str, url: str, headers: list[tuple[str, str]], body: bytes, signed: list[str],
               stamp: str, access_key: str, credential: AwsCredential, region: str) -> str:
    """The signature botocore computes for the request as received, over the
    headers it names as signed (each repeat kept: botocore joins them)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest, HTTPHeaders
    from botocore.credentials import Credentials

    kept = HTTPHeaders()
    for name, value in headers:
        if name.lower() in signed:
            kept.add_header(name.lower(), value)
    request = AWSRequest(method=method, url=url, data=body, headers=kept)
    request.context["timestamp"] = stamp
    signer = SigV4Auth(Credentials(access_key, credential.secret_key, credential.session_token), "bedrock", region)
    return signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
