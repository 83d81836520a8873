# -*- test-case-name: tests.test_login_google -*-
"""
The relay's Google login (Claude on Vertex AI): an OAuth2 bearer token,
``Authorization: Bearer ya29...``, minted by google-auth.

The credentials are a service account's key file (or any credentials file
google-auth reads: authorized user, workload identity federation, an
impersonated service account) named in the configuration, or Application
Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's user
login, workload identity on GKE, the metadata server of a GCE VM or Cloud
Run). google-auth is synchronous: every load and refresh runs in the
:class:`~twisted_relay.logins.base.CredentialSource`'s fetch, on the
logins' threads, never on the reactor; :meth:`GoogleLogin.authorize` only
puts the token in force on a request.

google-auth and requests are the ``[gcp]`` extra; :func:`require_google_auth`
says so at start when they are missing.
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

from twisted.web.http_headers import Headers

from twisted_relay.logins.base import DEFAULT_MARGIN, Credentials, CredentialSource, Login, LoginError, LoginThreads

__all__ = ["CLOUD_PLATFORM", "GoogleLogin", "GoogleToken", "require_google_auth"]

#: The OAuth2 scope Vertex AI needs.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
#: How long one call to a token endpoint or the metadata server may take
#: (google-auth's own default is 120 seconds).
DEFAULT_TIMEOUT = 30.0


def require_google_auth() -> None:
    """
    Check, at start, that the Google login can run.

    :raises LoginError: when google-auth or its requests transport is not
        installed, naming the extra that brings them.
    """
    try:
        import google.auth  # noqa: F401
        import google.auth.transport.requests  # noqa: F401
    except ImportError as missing:
        raise LoginError(
            "The Google login needs google-auth and requests (%s is missing): "
            "pip install 'twisted-relay[gcp]'" % (missing.name or "a module",)
        ) from None


class GoogleToken:
    """
    What the Google login holds: the access token, the quota project to
    bill (``x-goog-user-project``, for user credentials that name one) and
    the project the credentials belong to. Never shown.
    """

    __slots__ = ("token", "quota_project", "project")

    def __init__(self, token: str, quota_project: str | None = None, project: str | None = None):
        self.token = token
        self.quota_project = quota_project
        self.project = project

    def __repr__(self) -> str:
        return "GoogleToken(<hidden>, quota_project=%r, project=%r)" % (self.quota_project, self.project)


class _GoogleFetch:
    """
    The fetch of a :class:`GoogleLogin`: loads the credentials once, then
    refreshes them on every call. Runs on the logins' threads only, one
    call at a time (the source shares one fetch among its callers).
    """

    def __init__(self, credentials_file: str | None, scopes: Sequence[str], timeout: float):
        self._file = credentials_file
        self._scopes = list(scopes)
        self._timeout = timeout
        self._credentials: Any = None
        self._project: str | None = None

    def __call__(self) -> Credentials:
        from google.auth.exceptions import GoogleAuthError

        # A connection per fetch (one an hour), closed after it: none is left
        # open between refreshes.
        request = _timed_request(self._timeout)
        try:
            if self._credentials is None:
                self._load(request)
            self._credentials.refresh(request)
        except GoogleAuthError as failure:
            # One line of google-auth's words, never what it carried along
            # (a RefreshError's second argument is the endpoint's answer).
            raise LoginError(_first_line(failure)) from None
        except Exception as failure:
            raise LoginError("%s: %s" % (type(failure).__name__, _first_line(failure))) from None
        finally:
            request.session.close()
        credentials = self._credentials
        if not credentials.token:
            raise LoginError("google-auth refreshed the credentials but gave no token")
        token = GoogleToken(credentials.token, getattr(credentials, "quota_project_id", None), self._project)
        return Credentials(token, _unix_time(credentials.expiry))

    def _load(self, request: Any) -> None:
        import google.auth

        if self._file is not None:
            credentials, project = google.auth.load_credentials_from_file(self._file, scopes=self._scopes)
        else:
            credentials, project = google.auth.default(scopes=self._scopes, request=request)
        self._credentials, self._project = credentials, project


def _timed_request(timeout: float) -> Any:
    """google-auth's requests transport on a session of its own, each call
    bounded by ``timeout`` unless the caller bounds it (the metadata
    server's probes do)."""
    import requests
    from google.auth.transport.requests import Request

    class TimedRequest(Request):
        def __call__(self, url, method="GET", body=None, headers=None, timeout=timeout, **kwargs):
            return super().__call__(url, method=method, body=body, headers=headers, timeout=timeout, **kwargs)

    return TimedRequest(requests.Session())


def _first_line(failure: Exception) -> str:
    text = failure.args[0] if failure.args else ""
    text = str(text).strip() or type(failure).__name__
    return " ".join(text.splitlines()[0].split())[:300]


def _unix_time(expiry: datetime.datetime | None) -> float | None:
    """google-auth's expiry (naive UTC) as Unix time."""
    if expiry is None:
        return None
    if expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=datetime.timezone.utc)
    return expiry.timestamp()


class GoogleLogin(Login):
    """
    A Google OAuth2 bearer token on every request, refreshed ahead of its
    expiry on the logins' threads.

    :param reactor: the reactor the refreshes are timed and reported on.
    :param threads: the logins' thread pool.
    :param credentials_file: a credentials file google-auth reads (a
        service account's key file); ``None``: Application Default
        Credentials.
    :param scopes: the OAuth2 scopes asked for.
    :param margin: fetch a new token this many seconds before the current
        one expires (a short-lived one at half its life).
    :param timeout: the longest one call to a token endpoint may take.
    :raises LoginError: when google-auth is not installed.
    """

    name = "google"

    def __init__(
        self,
        reactor,
        threads: LoginThreads,
        *,
        credentials_file: str | None = None,
        scopes: Sequence[str] = (CLOUD_PLATFORM,),
        margin: float = DEFAULT_MARGIN,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        require_google_auth()
        if credentials_file is not None:
            describe = "Google credentials from the file %s" % (credentials_file,)
        else:
            describe = "Google Application Default Credentials"
        fetch = _GoogleFetch(credentials_file, scopes, timeout)
        self.source = CredentialSource(reactor, threads, fetch, describe, margin)

    def __repr__(self) -> str:
        return "<GoogleLogin: %s>" % (self.source.describe,)

    @property
    def project(self) -> str | None:
        """The project the credentials belong to, when they say (known after :meth:`start`)."""
        current = self.source.current
        return None if current is None else current.value.project


    def authorize(self, method: bytes, url: str, headers: Headers, body: bytes | None) -> None:
        current = self.source.current
        if current is None:
            raise LoginError("%s: no token yet (the login has not started)" % (self.source.describe,))
        token: GoogleToken = current.value
        headers.setRawHeaders(b"authorization", [b"Bearer " + token.token.encode("ascii")])
        if token.quota_project:
            headers.setRawHeaders(b"x-goog-user-project", [token.quota_project.encode("ascii")])
