# -*- test-case-name: tests.test_signin_store -*-
"""
Where sign-in keeps what it shares between requests, and between relays:
device grants, refresh tokens, revoked session tokens.

:class:`DatabaseStore` keeps them in the usage ledger's database
(:mod:`twisted_relay.signin_sql`), which every relay behind one name shares:
each call runs on the ledger's thread (``Ledger.on_database``), never on the
reactor's, and fails with :class:`~twisted_relay.ledger_sql.LedgerError`
when the database cannot be used. :class:`MemoryStore` keeps them in this
process, for a relay without ``--usage-db``. Both answer Deferreds, with the
same meanings (the functions of :mod:`twisted_relay.signin_sql` document each).
"""

from __future__ import annotations

from dataclasses import replace

from twisted.internet.defer import Deferred, succeed

from twisted_relay import signin_sql
from twisted_relay.signin.device_flow import APPROVED, BrowserLogin, DeviceGrant, poll

__all__ = ["DatabaseStore", "MemoryStore", "store_for"]


def store_for(ledger):
    """The store of a relay: its ledger's database when it has one (``on_database``), else this process's memory."""
    return DatabaseStore(ledger) if hasattr(ledger, "on_database") else MemoryStore()


class DatabaseStore:
    """Sign-in's state in the ledger's database, shared by every relay that writes to it."""

    shared = True

    def __init__(self, ledger):
        self._ledger = ledger

    def __repr__(self) -> str:
        return "DatabaseStore()"

    def add_grant(self, grant: DeviceGrant, now: float) -> Deferred:
        return self._ledger.on_database(signin_sql.add_grant, grant, now)

    def grant_of_user_code(self, user_code: str, now: float) -> Deferred:
        return self._ledger.on_database(signin_sql.grant_of_user_code, user_code, now)

    def start_login(self, user_code: str, login: BrowserLogin, now: float) -> Deferred:
        return self._ledger.on_database(signin_sql.start_login, user_code, login, now)

    def take_login(self, state_hash: str) -> Deferred:
        return self._ledger.on_database(signin_sql.take_login, state_hash)

    def settle_grant(self, device_hash: str, identity: dict | None, idp_refresh: str | None) -> Deferred:
        return self._ledger.on_database(signin_sql.settle_grant, device_hash, identity, idp_refresh)

    def poll_grant(self, device_hash: str, now: float, refresh: tuple[str, float] | None) -> Deferred:
        return self._ledger.on_database(signin_sql.poll_grant, device_hash, now, refresh)

    def refresh_of(self, token_hash: str, now: float) -> Deferred:
        return self._ledger.on_database(signin_sql.refresh_of, token_hash, now)

    def rotate_refresh(self, old_hash: str, new_hash: str, identity: dict, idp_refresh: str, expires_at: float) -> Deferred:
        return self._ledger.on_database(signin_sql.rotate_refresh, old_hash, new_hash, identity, idp_refresh, expires_at)

    def delete_refresh(self, token_hash: str) -> Deferred:
        return self._ledger.on_database(signin_sql.delete_refresh, token_hash)

    def revoke(self, jti: str, expires_at: float) -> Deferred:
        return self._ledger.on_database(signin_sql.revoke, jti, expires_at)

    def revocations(self, now: float, prune: bool = False) -> Deferred:
        return self._ledger.on_database(signin_sql.revocations, now, prune)


class MemoryStore:
    """Sign-in's state in this process only (one relay, one process)."""

    shared = False

    def __init__(self):
        self._grants: dict[str, DeviceGrant] = {}
        # digest -> (identity, sealed provider refresh token, expires at)
        self._refresh: dict[str, tuple[dict, str, float]] = {}
        self._revoked: dict[str, float] = {}

    def __repr__(self) -> str:
        return "MemoryStore(%d grants, %d refresh tokens, %d revoked)" % (
            len(self._grants), len(self._refresh), len(self._revoked))

    def _prune(self, now: float) -> None:
        for table in (self._grants,):
            for key in [key for key, grant in table.items() if grant.expires_at <= now]:
                del table[key]
        for key in [key for key, row in self._refresh.items() if row[2] <= now]:
            del self._refresh[key]
        for key in [key for key, expires_at in self._revoked.items() if expires_at <= now]:
            del self._revoked[key]

    def _grant_where(self, test) -> DeviceGrant | None:
        return next((grant for grant in self._grants.values() if test(grant)), None)

    def add_grant(self, grant: DeviceGrant, now: float) -> Deferred:
        self._prune(now)
        if self._grant_where(lambda g: g.user_code == grant.user_code) is not None or grant.device_hash in self._grants:
            return succeed(False)
        self._grants[grant.device_hash] = grant
        return succeed(True)

    def grant_of_user_code(self, user_code: str, now: float) -> Deferred:
        return succeed(self._grant_where(lambda g: g.user_code == user_code and g.expires_at > now))

    def start_login(self, user_code: str, login: BrowserLogin, now: float) -> Deferred:
        grant = self._grant_where(lambda g: g.user_code == user_code and g.pending and g.expires_at > now)
        if grant is None:
            return succeed(False)
        self._grants[grant.device_hash] = replace(grant, login=login)
        return succeed(True)

    def take_login(self, state_hash: str) -> Deferred:
        grant = self._grant_where(lambda g: g.login is not None and g.login.state_hash == state_hash)
        if grant is not None:
            self._grants[grant.device_hash] = replace(grant, login=None)
        return succeed(grant)

    def settle_grant(self, device_hash: str, identity: dict | None, idp_refresh: str | None) -> Deferred:
        grant = self._grants.get(device_hash)
        if grant is None or not grant.pending:
            return succeed(False)
        self._grants[device_hash] = grant.approved(identity, idp_refresh) if identity is not None else grant.denied()
        return succeed(True)

    def poll_grant(self, device_hash: str, now: float, refresh: tuple[str, float] | None) -> Deferred:
        grant = self._grants.get(device_hash)
        if grant is None:
            return succeed(("invalid_grant", None))
        verdict, kept = poll(grant, now)
        if kept is None:
            del self._grants[device_hash]
        else:
            self._grants[device_hash] = kept
        if verdict == APPROVED and grant.idp_refresh is not None and refresh is not None:
            self._refresh[refresh[0]] = (grant.identity, grant.idp_refresh, refresh[1])
        return succeed((verdict, grant))

    def refresh_of(self, token_hash: str, now: float) -> Deferred:
        row = self._refresh.get(token_hash)
        return succeed(None if row is None or row[2] <= now else (row[0], row[1]))

    def rotate_refresh(self, old_hash: str, new_hash: str, identity: dict, idp_refresh: str, expires_at: float) -> Deferred:
        if self._refresh.pop(old_hash, None) is None:
            return succeed(False)
        self._refresh[new_hash] = (identity, idp_refresh, expires_at)
        return succeed(True)

    def delete_refresh(self, token_hash: str) -> Deferred:
        return succeed(self._refresh.pop(token_hash, None) is not None)

    def revoke(self, jti: str, expires_at: float) -> Deferred:
        self._revoked.setdefault(jti, expires_at)
        return succeed(None)

    def revocations(self, now: float, prune: bool = False) -> Deferred:
        if prune:
            self._prune(now)
        return succeed({jti: expires_at for jti, expires_at in self._revoked.items() if expires_at > now})
