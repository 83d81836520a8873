"""
Sign-in's store (:mod:`twisted_relay.signin.store`): the same behaviour from
the memory store, the ledger's SQLite file and a real PostgreSQL
(:mod:`twisted_relay.signin_sql`): a device grant's browser step, single
use and approval, polls, refresh tokens rotated once, revocations; and a
ledger of schema 4 gains sign-in's tables when opened.
"""

from __future__ import annotations

import os
import sqlite3

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from twisted_relay.ledger import Ledger
from twisted_relay.ledger_sql import open_ledger
from twisted_relay.signin.device_flow import BrowserLogin, digest, new_grant
from twisted_relay.signin.store import DatabaseStore, MemoryStore

from tests import postgres_server

NOW = 1_800_000_000.0
ALICE = {"sub": "sub-alice", "email": "alice@example.com", "groups": ["engineering"]}


class _StoreContract:
    """What every store does; a subclass makes :meth:`store`."""

    def store(self):
        raise NotImplementedError

    async def test_grant_through_the_browser(self):
        store = self.store()
        device_code, grant = new_grant(NOW, 5)
        self.assertTrue(await store.add_grant(grant, NOW))
        self.assertEqual((await store.grant_of_user_code(grant.user_code, NOW)).device_hash, digest(device_code))
        self.assertIsNone(await store.grant_of_user_code(grant.user_code, NOW + 601))
        login = BrowserLogin(digest("state"), digest("cookie"), "verifier-" + "v" * 40, "nonce", NOW + 600)
        self.assertTrue(await store.start_login(grant.user_code, login, NOW))
        self.assertFalse(await store.start_login("BBBB-BBBB", login, NOW))
        taken = await store.take_login(digest("state"))
        self.assertEqual((taken.device_hash, taken.login), (grant.device_hash, login))
        # One use.
        self.assertIsNone(await store.take_login(digest("state")))
        verdict, _ = await store.poll_grant(grant.device_hash, NOW, None)
        self.assertEqual(verdict, "authorization_pending")
        self.assertTrue(await store.settle_grant(grant.device_hash, ALICE, "sealed-idp-refresh"))
        self.assertFalse(await store.settle_grant(grant.device_hash, None, None))
        verdict, approved = await store.poll_grant(grant.device_hash, NOW + 10, (digest("refresh-1"), NOW + 86400))
        self.assertEqual((verdict, approved.identity), ("approved", ALICE))
        self.assertEqual(await store.refresh_of(digest("refresh-1"), NOW + 11), (ALICE, "sealed-idp-refresh"))
        # The device code is spent.
        self.assertEqual((await store.poll_grant(grant.device_hash, NOW + 20, None))[0], "invalid_grant")

    async def test_denied_and_slow(self):
        store = self.store()
        _, grant = new_grant(NOW, 5)
        await store.add_grant(grant, NOW)
        await store.poll_grant(grant.device_hash, NOW, None)
        verdict, _ = await store.poll_grant(grant.device_hash, NOW + 1, None)
        self.assertEqual(verdict, "slow_down")
        await store.settle_grant(grant.device_hash, None, None)
        self.assertEqual((await store.poll_grant(grant.device_hash, NOW + 20, None))[0], "access_denied")
        _, late = new_grant(NOW, 5)
        await store.add_grant(late, NOW)
        self.assertEqual((await store.poll_grant(late.device_hash, NOW + 600, None))[0], "expired_token")

    async def test_no_refresh_without_the_providers(self):
        """A provider that gave no refresh token: the session cannot be refreshed, so no refresh token is kept."""
        store = self.store()
        _, grant = new_grant(NOW, 5)
        await store.add_grant(grant, NOW)
        await store.settle_grant(grant.device_hash, ALICE, None)
        await store.poll_grant(grant.device_hash, NOW, (digest("refresh-1"), NOW + 86400))
        self.assertIsNone(await store.refresh_of(digest("refresh-1"), NOW))

    async def test_user_code_taken(self):
        store = self.store()
        _, first = new_grant(NOW, 5)
        _, second = new_grant(NOW, 5)
        await store.add_grant(first, NOW)
        self.assertFalse(await store.add_grant(second.__class__(second.device_hash, first.user_code, NOW + 600, 5), NOW))

    async def test_refresh_rotated_once(self):
        store = self.store()
        _, grant = new_grant(NOW, 5)
        await store.add_grant(grant, NOW)
        await store.settle_grant(grant.device_hash, ALICE, "sealed-1")
        await store.poll_grant(grant.device_hash, NOW, (digest("r1"), NOW + 100))
        self.assertTrue(await store.rotate_refresh(digest("r1"), digest("r2"), ALICE, "sealed-2", NOW + 200))
        self.assertFalse(await store.rotate_refresh(digest("r1"), digest("r3"), ALICE, "sealed-3", NOW + 200))
        self.assertIsNone(await store.refresh_of(digest("r1"), NOW))
        self.assertIsNone(await store.refresh_of(digest("r3"), NOW))
        self.assertEqual(await store.refresh_of(digest("r2"), NOW), (ALICE, "sealed-2"))
        self.assertIsNone(await store.refresh_of(digest("r2"), NOW + 200))
        self.assertTrue(await store.delete_refresh(digest("r2")))
        self.assertFalse(await store.delete_refresh(digest("r2")))

    async def test_revocations(self):
        store = self.store()
        await store.revoke("jti-1", NOW + 60)
        await store.revoke("jti-1", NOW + 60)
        await store.revoke("jti-2", NOW + 10)
        self.assertEqual(await store.revocations(NOW), {"jti-1": NOW + 60, "jti-2": NOW + 10})
        self.assertEqual(await store.revocations(NOW + 30, True), {"jti-1": NOW + 60})


for _name in [n for n in vars(_StoreContract) if n.startswith("test_")]:
    # Each contract test as a coroutine trial waits for.
    _test = getattr(_StoreContract, _name)
    setattr(_StoreContract, _name, (lambda test: lambda self: ensureDeferred(test(self)))(_test))


class MemoryStoreTests(_StoreContract, TestCase):
    def store(self):
        return MemoryStore()


class SQLiteStoreTests(_StoreContract, TestCase):
    """The store in the ledger's SQLite file, its calls on the ledger's thread."""

    def store(self):
        folder = self.mktemp()
        os.makedirs(folder)
        return self.running(os.path.join(folder, "usage.sqlite"))

    def running(self, target: str) -> DatabaseStore:
        from twisted.internet import reactor

        ledger = Ledger(open_ledger(target), reactor=reactor)
        ledger.startService()
        self.addCleanup(ledger.stopService)
        return DatabaseStore(ledger)


class PostgresStoreTests(SQLiteStoreTests):
    """The same on a real PostgreSQL (each test a new database of the shared server)."""

    skip = postgres_server.SKIP_REASON

    def store(self):
        server = postgres_server.shared_server()
        return self.running(server.new_database())


class SchemaTests(TestCase):
    def test_schema_4_gains_the_tables(self):
        folder = self.mktemp()
        os.makedirs(folder)
        path = os.path.join(folder, "usage.sqlite")
        database = open_ledger(path)
        database.open()
        database.close()
        with sqlite3.connect(path) as connection:
            for table in ("relay_signin_grants", "relay_signin_refresh", "relay_signin_revoked"):
                connection.execute("DROP TABLE %s" % (table,))
            connection.execute("UPDATE relay_usage_meta SET value = '4' WHERE name = 'schema_version'")
        database = open_ledger(path)
        database.open()
        from twisted_relay.signin_sql import revocations, revoke

        revoke(database, "jti", NOW + 5)
        self.assertEqual(revocations(database, NOW), {"jti": NOW + 5})
        database.close()
        with sqlite3.connect(path) as connection:
            self.assertEqual(connection.execute("SELECT value FROM relay_usage_meta WHERE name = 'schema_version'").fetchone(), ("5",))
