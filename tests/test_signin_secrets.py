"""
No secret of the sign-in in anything the relay writes down or shows: a real
sign-in with a relay process (``twistd -n relay --config FILE``, dumps on, a
SQLite ledger), then its log, its dumps, ``/metrics``, the usage page, the
ledger's tables and its command line are searched for every secret the
sign-in handled (``docs/signin.md``).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import sqlite3
import subprocess

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.test_signin_cluster import ADMIN_KEY, CLIENT_SECRET, SESSION_SECRET, SignedInCluster


class _RecordingSite(Site):
    """The identity provider's site, keeping what every request sent and every answer said (its codes and tokens)."""

    def __init__(self, resource):
        super().__init__(resource)
        self.exchanged: list[bytes] = []

    def getResourceFor(self, request):
        self.exchanged.append(request.uri)
        self.exchanged.append(request.content.read())
        request.content.seek(0)
        write = request.write

        def recorded(data):
            self.exchanged.append(data)
            return write(data)

        request.write = recorded
        return super().getResourceFor(request)


def idp_secrets(exchanged: list[bytes]) -> set[str]:
    """The codes and tokens the identity provider handed out, from its answers and the requests that carried them."""
    found = set()
    for data in exchanged:
        text = data.decode("utf-8", "replace")
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if isinstance(answer, dict):
            found.update(answer[name] for name in ("access_token", "refresh_token", "id_token") if name in answer)
        for part in text.replace("?", "&").split("&"):
            name, _, value = part.partition("=")
            if name == "code" and value:
                found.add(value)
    return found


def unsigned(header: dict, claims: dict) -> str:
    """An ID token with ``alg: none`` and no signature (which the relay must refuse)."""

    def part(value: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return "%s.%s." % (part({**header, "alg": "none"}), part(claims))


class NoSecretWrittenTests(TestCase):
    """Session and refresh tokens, the provider's tokens and codes, the client and session secrets, the device code."""

    timeout = 60

    async def test_nothing_written_holds_a_secret(self):
        folder = os.path.abspath(self.mktemp())
        os.makedirs(folder)
        ledger = os.path.join(folder, "usage.sqlite")
        dumps = os.path.join(folder, "dumps")
        world = SignedInCluster(self, ledger, relays=1, nginx=False, relay_options=("--dump-dir", dumps),
                                idp_site=_RecordingSite)
        recording = world.idp_site
        await world.start()
        relay = world.relay(0)

        # The sign-in, a request, a refresh.
        tokens = await world.signed_in(relay, relay)
        self.assertEqual((await world.message(relay, tokens["access_token"])).status_code, 200)
        refreshed = await world.call("POST", relay + "/oauth/token",
                                     data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]})
        self.assertEqual(refreshed.status_code, 200, refreshed.text)
        fresh = refreshed.json()
        # The upstream refuses a request (max_tokens 0): a dump is written.
        refused_upstream = await world.message(relay, fresh["access_token"], max_tokens=0)
        self.assertEqual(refused_upstream.status_code, 400, refused_upstream.text)
        # The person's usage endpoint, as Claude Code's /usage reads it.
        own_usage = await world.call("GET", relay + "/api/oauth/usage", headers={"Authorization": "Bearer " + fresh["access_token"]})
        self.assertEqual(own_usage.status_code, 200, own_usage.text)
        # The provider's answer to a refresh unusable (an ID token signed with alg "none"), then the
        # provider refusing it (the person disabled): refused, and logged.
        world.idp.id_token_edit = unsigned
        bad_answer = await world.call("POST", relay + "/oauth/token",
                                      data={"grant_type": "refresh_token", "refresh_token": fresh["refresh_token"]})
        self.assertNotEqual(bad_answer.status_code, 200, bad_answer.text)
        world.idp.id_token_edit = None
        world.idp.disable_user("alice@example.com")
        leaver = await world.call("POST", relay + "/oauth/token",
                                  data={"grant_type": "refresh_token", "refresh_token": fresh["refresh_token"]})
        self.assertEqual((leaver.status_code, leaver.json()["error"]), (401, "invalid_grant"))
        # Logout, then the revoked token and refresh token refused.
        for token, hint in ((fresh["access_token"], "access_token"), (fresh["refresh_token"], "refresh_token")):
            revoked = await world.call("POST", relay + "/oauth/revoke", data={"token": token, "token_type_hint": hint})
            self.assertEqual(revoked.status_code, 200)
        refused = await world.message(relay, fresh["access_token"])
        self.assertEqual(refused.status_code, 401, refused.text)
        gone = await world.call("POST", relay + "/oauth/token",
                                data={"grant_type": "refresh_token", "refresh_token": fresh["refresh_token"]})
        self.assertEqual(gone.status_code, 401, gone.text)
        # A token that is no session token of this relay's (a forged one).
        forged = tokens["access_token"][:-4] + ("AAAA" if not tokens["access_token"].endswith("AAAA") else "BBBB")
        self.assertEqual((await world.message(relay, forged)).status_code, 401)

        secrets = {
            "session token": tokens["access_token"], "refreshed session token": fresh["access_token"],
            "forged session token": forged, "refresh token": tokens["refresh_token"],
            "refreshed refresh token": fresh["refresh_token"], "device code": tokens["device_code"],
            "client secret": CLIENT_SECRET, "session secret": SESSION_SECRET, "admin key": ADMIN_KEY,
        }
        handed_out = idp_secrets(recording.exchanged)
        self.assertGreaterEqual(len(handed_out), 5)  # a code, and at the sign-in and the refresh: three tokens each
        secrets.update(("identity provider's code or token %d" % (n,), value) for n, value in enumerate(sorted(handed_out)))

        # What the relay wrote and shows.
        written: dict[str, str] = {}
        metrics = await world.call("GET", relay + "/metrics")
        self.assertEqual(metrics.status_code, 200)
        written["/metrics"] = metrics.text
        usage = await world.call("GET", relay + "/admin/usage", headers={"x-api-key": ADMIN_KEY})
        self.assertEqual(usage.status_code, 200, usage.text)
        self.assertIn("alice@example.com", usage.text)
        written["/admin/usage"] = usage.text
        written["/api/oauth/usage"] = own_usage.text
        await deferLater(reactor, 0.5, lambda: None)  # the dump's thread, the log's last lines
        dump_files = [os.path.join(root, name) for root, _, names in os.walk(dumps) for name in names]
        self.assertTrue(dump_files, "no dump was written")
        for path in dump_files:
            with open(path, encoding="utf-8", errors="replace") as f:
                written["dump " + os.path.basename(path)] = f.read()
        self.assertIn("max_tokens", "".join(v for k, v in written.items() if k.startswith("dump ")))
        written["relay log"] = world.log(0)
        with open(os.path.join(world.folder, "upstream.log"), encoding="utf-8", errors="replace") as f:
            written["upstream's log"] = f.read()  # what went upstream: never a session token
        self.assertIn("alice@example.com", written["relay log"])
        with sqlite3.connect(ledger) as connection:
            written["ledger"] = "\n".join(connection.iterdump())
        self.assertIn("relay_signin_revoked", written["ledger"])
        for process in world.cluster.processes:
            with open("/proc/%d/cmdline" % (process.pid,), "rb") as f:
                written["command line of %s" % (process.args[0],)] = f.read().replace(b"\0", b" ").decode()
            if shutil.which("ps"):
                shown = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(process.pid)], capture_output=True,
                                       text=True, timeout=10)
                written["ps of %s" % (process.args[0],)] = shown.stdout

        leaks = ["%s in %s" % (secret, where) for secret, value in secrets.items()
                 for where, text in written.items() if value in text]
        self.assertEqual(leaks, [])
