"""
The ``[signin]`` table of the ``--config`` file (:mod:`twisted_relay.signin.config`),
read through the file as ``twistd relay`` reads it: its secrets from
``env:VAR`` or ``file:PATH``, one-line errors naming the key and never a
value, the secrets redacted and kept out of ``repr``, carried to worker
processes.
"""

from __future__ import annotations

import json
import os

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay.config import RelayConfig
from twisted_relay.settings import SettingsError, read_settings
from twisted_relay.signin.config import SignInConfig
from twisted_relay.start_checks import StartupError, run_start_checks, start_checks_for

SESSION_SECRET = "session-secret-of-more-than-32-characters"
CLIENT_SECRET = "oidc-client-secret-value-0001"

GOOD = """
[signin]
public_url = "https://relay.corp.internal/"
issuer = "https://login.example.com/realms/corp"
client_id = "twisted-relay"
client_secret = "env:RELAY_OIDC_SECRET"
allowed_email_domains = ["Example.com"]
allowed_groups = ["engineering"]
session_secret = "file:session.secret"
session_ttl = 600
login_notice = "Sign in with your corp account."
managed_settings = "managed-settings.json"
revocation_poll = 1.5
[signin.groups]
"eng-platform" = "platform"
"eng" = "engineering"
"""


class SignInTableTests(SynchronousTestCase):
    def setUp(self):
        self.folder = self.mktemp()
        os.makedirs(self.folder)
        with open(os.path.join(self.folder, "session.secret"), "w") as f:
            f.write(SESSION_SECRET + "\n")
        self.environ = {"RELAY_OIDC_SECRET": CLIENT_SECRET}

    def read(self, text: str) -> RelayConfig:
        path = os.path.join(self.folder, "relay.toml")
        with open(path, "w") as f:
            f.write(text)
        return read_settings({}, path, environ=self.environ)

    def refused(self, text: str) -> str:
        with self.assertRaises(SettingsError) as caught:
            self.read(text)
        message = str(caught.exception)
        self.assertEqual(len(message.splitlines()), 1, message)
        for secret in (SESSION_SECRET, CLIENT_SECRET, "short-secret"):
            self.assertNotIn(secret, message)
        return message

    def test_read(self):
        signin = self.read(GOOD).signin
        self.assertEqual(
            (signin.public_url, signin.issuer, signin.client_id, signin.client_secret, signin.session_secret),
            ("https://relay.corp.internal", "https://login.example.com/realms/corp", "twisted-relay", CLIENT_SECRET,
             SESSION_SECRET),
        )
        self.assertEqual(signin.allowed_email_domains, ("example.com",))
        self.assertEqual(signin.groups, (("eng-platform", "platform"), ("eng", "engineering")))
        self.assertEqual((signin.session_ttl, signin.revocation_poll, signin.poll_interval), (600.0, 1.5, 5))
        self.assertEqual(signin.managed_settings, os.path.join(os.path.abspath(self.folder), "managed-settings.json"))
        self.assertEqual(signin.redirect_uri, "https://relay.corp.internal/oauth/callback")
        self.assertEqual(signin.scopes, ("openid", "profile", "email", "offline_access"))

    def test_secrets_kept_out_of_sight(self):
        """Redacted wherever the relay's keys are, never in ``repr``; carried whole to worker processes."""
        config = self.read(GOOD)
        self.assertIn(SESSION_SECRET, config.secrets())
        self.assertIn(CLIENT_SECRET, config.secrets())
        for shown in (repr(config), repr(config.signin)):
            self.assertNotIn(SESSION_SECRET, shown)
            self.assertNotIn(CLIENT_SECRET, shown)
        again = RelayConfig.from_dict(json.loads(json.dumps(config.to_dict())))
        self.assertEqual(again.signin, config.signin)

    def test_mistakes(self):
        cases = {
            GOOD.replace('issuer = "https://login.example.com/realms/corp"\n', ""): "[signin] issuer: missing",
            GOOD.replace("file:session.secret", "short-secret"): "[signin] session_secret: must be at least 32",
            GOOD.replace("env:RELAY_OIDC_SECRET", "env:NOT_SET_ANYWHERE"): "[signin] client_secret: the environment variable",
            GOOD.replace("file:session.secret", "file:missing.secret"): "[signin] session_secret: cannot read the key file",
            GOOD.replace("https://relay.corp.internal/", "https://relay.corp.internal/sub"): "[signin] public_url: must be the relay's origin",
            GOOD.replace("https://relay.corp.internal/", "ftp://relay"): "[signin] public_url: must be an http",
            GOOD.replace("session_ttl = 600", "session_ttl = -1"): "[signin] session_ttl: must be a number",
            GOOD.replace("session_ttl = 600", "session_ttl = 86401"): "[signin] session_ttl: must be at most 86400",
            GOOD.replace('"eng" = "engineering"', '"eng" = "not a name"'): "[signin] groups eng: the relay group must be",
            GOOD.replace("revocation_poll = 1.5", "revocation_pol = 1.5"): "[signin] revocation_pol: unknown key",
            GOOD.replace("Sign in with your corp account.", "x" * 501): "[signin] login_notice: must be text of at most 500",
            # Over http off loopback the client secret, the codes and the provider's keys cross the network in clear.
            GOOD.replace("https://login.example.com", "http://login.example.com"): "[signin] issuer: must be an https:// URL",
            GOOD.replace("https://relay.corp.internal/", "http://10.0.0.5:8080"): "[signin] public_url: must be an https:// URL",
        }
        for text, expected in cases.items():
            self.assertIn(expected, self.refused(text))

    def test_workers_need_a_database(self):
        """Sign-ins are shared among worker processes through the ledger's database only: refused at start without one."""
        signin = SignInConfig("http://127.0.0.1:1", "http://127.0.0.1:2", "relay", SESSION_SECRET)
        checks = start_checks_for(RelayConfig(listen=(), dump_dir=None, workers=2, signin=signin), logins=False)
        with self.assertRaises(StartupError) as caught:
            run_start_checks(checks)
        self.assertIn("--usage-db", str(caught.exception))
        run_start_checks(start_checks_for(RelayConfig(listen=(), dump_dir=None, workers=1, signin=signin), logins=False))
