# -*- test-case-name: tests.test_signin_store -*-
"""
Sign-in's shared state in the ledger's database (:mod:`twisted_relay.ledger_sql`;
its tables made with the ledger's, schema 5), so that every relay behind one
name sees the same sign-ins (``docs/signin.md``):

- ``relay_signin_grants``: device grants, by the digest of their device
  code and by user code, with the browser step under way;
- ``relay_signin_refresh``: the relay's refresh tokens, by digest, each
  with the identity it speaks for and the identity provider's refresh
  token (sealed), until it is used (rotated), revoked or expires;
- ``relay_signin_revoked``: the ``jti`` of each revoked session token,
  until the token expires.

No secret is kept in clear: device codes, refresh tokens, ``state`` and the
browser's cookie as SHA-256 digests, the provider's refresh token sealed.
Every call blocks; the store runs them on the ledger's thread. No Twisted here.
"""

from __future__ import annotations

import json

from twisted_relay.signin.device_flow import APPROVED, BrowserLogin, DeviceGrant, poll

__all__ = [
    "SCHEMA",
    "add_grant",
    "delete_refresh",
    "grant_of_user_code",
    "poll_grant",
    "refresh_of",
    "revocations",
    "revoke",
    "rotate_refresh",
    "settle_grant",
    "start_login",
    "take_login",
]

#: The tables' statements, run with the ledger's schema.
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS relay_signin_grants ("
    "device_hash TEXT PRIMARY KEY, user_code TEXT NOT NULL UNIQUE, expires_at DOUBLE PRECISION NOT NULL, "
    "poll_interval INTEGER NOT NULL, last_poll DOUBLE PRECISION, status TEXT NOT NULL, identity TEXT, "
    "idp_refresh TEXT, state_hash TEXT UNIQUE, browser_hash TEXT, code_verifier TEXT, nonce TEXT, "
    "login_expires_at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS relay_signin_refresh ("
    "token_hash TEXT PRIMARY KEY, identity TEXT NOT NULL, idp_refresh TEXT NOT NULL, expires_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS relay_signin_revoked (jti TEXT PRIMARY KEY, expires_at DOUBLE PRECISION NOT NULL)",
)

_GRANT_COLUMNS = (
    "device_hash, user_code, expires_at, poll_interval, last_poll, status, identity, idp_refresh, "
    "state_hash, browser_hash, code_verifier, nonce, login_expires_at"
)


def _grant_of(row) -> DeviceGrant:
    (device_hash, user_code, expires_at, interval, last_poll, status, identity, idp_refresh,
     state_hash, browser_hash, code_verifier, nonce, login_expires_at) = row
    login = None
    if state_hash is not None:
        login = BrowserLogin(state_hash, browser_hash, code_verifier, nonce, float(login_expires_at))
    return DeviceGrant(
        device_hash, user_code, float(expires_at), int(interval), None if last_poll is None else float(last_poll),
        status, None if identity is None else json.loads(identity), idp_refresh, login,
    )


def _select_grant(database, cursor, where: str, value) -> DeviceGrant | None:
    cursor.execute(database.sql("SELECT %s FROM relay_signin_grants WHERE %s = ?" % (_GRANT_COLUMNS, where)), (value,))
    row = cursor.fetchone()
    return None if row is None else _grant_of(row)


def add_grant(database, grant: DeviceGrant, now: float) -> bool:
    """Keep a new grant (grants that have ended go); ``False`` when its user code is taken."""

    def add(connection):
        cursor = connection.cursor()
        cursor.execute(database.sql("DELETE FROM relay_signin_grants WHERE expires_at <= ?"), (now,))
        cursor.execute(
            database.sql(
                "INSERT INTO relay_signin_grants (device_hash, user_code, expires_at, poll_interval, status) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
            ),
            (grant.device_hash, grant.user_code, grant.expires_at, grant.interval, grant.status),
        )
        return cursor.rowcount == 1

    return database.run(add)


def grant_of_user_code(database, user_code: str, now: float) -> DeviceGrant | None:
    """The live grant of a user code, or ``None``."""

    def select(connection):
        grant = _select_grant(database, connection.cursor(), "user_code", user_code)
        return grant if grant is not None and grant.expires_at > now else None

    return database.run(select)


def start_login(database, user_code: str, login: BrowserLogin, now: float) -> bool:
    """Put a browser step on the pending grant of a user code (replacing any before); ``False`` if none is pending."""

    def update(connection):
        cursor = connection.cursor()
        cursor.execute(
            database.sql(
                "UPDATE relay_signin_grants SET state_hash = ?, browser_hash = ?, code_verifier = ?, nonce = ?, "
                "login_expires_at = ? WHERE user_code = ? AND status = 'pending' AND expires_at > ?"
            ),
            (login.state_hash, login.browser_hash, login.code_verifier, login.nonce, login.expires_at, user_code, now),
        )
        return cursor.rowcount == 1

    return database.run(update)


def take_login(database, state_hash: str) -> DeviceGrant | None:
    """The grant whose browser step has this ``state`` (with it), the step taken off it: one use."""

    def take(connection):
        cursor = connection.cursor()
        database.serialize(cursor, ["signin-state:" + state_hash])
        grant = _select_grant(database, cursor, "state_hash", state_hash)
        if grant is not None:
            cursor.execute(
                database.sql(
                    "UPDATE relay_signin_grants SET state_hash = NULL, browser_hash = NULL, code_verifier = NULL, "
                    "nonce = NULL, login_expires_at = NULL WHERE device_hash = ?"
                ),
                (grant.device_hash,),
            )
        return grant

    return database.run(take)


def settle_grant(database, device_hash: str, identity: dict | None, idp_refresh: str | None) -> bool:
    """Approve a pending grant for ``identity``, or deny it (``identity`` ``None``); ``False`` if it was not pending."""

    def update(connection):
        cursor = connection.cursor()
        cursor.execute(
            database.sql(
                "UPDATE relay_signin_grants SET status = ?, identity = ?, idp_refresh = ? "
                "WHERE device_hash = ? AND status = 'pending'"
            ),
            (APPROVED if identity is not None else "denied", None if identity is None else json.dumps(identity),
             idp_refresh, device_hash),
        )
        return cursor.rowcount == 1

    return database.run(update)


def poll_grant(
    database, device_hash: str, now: float, refresh: tuple[str, float] | None
) -> tuple[str, DeviceGrant | None]:
    """
    One poll of a grant (:func:`~twisted_relay.signin.device_flow.poll`),
    under its lock: what it gets and the grant. An approved grant is used up
    by it, and when the provider gave a refresh token, ``refresh`` (a new
    refresh token's digest and end) is kept for its identity in the same
    transaction. ``invalid_grant`` for a device code the relay does not know.
    """

    def run(connection):
        cursor = connection.cursor()
        database.serialize(cursor, ["signin-grant:" + device_hash])
        grant = _select_grant(database, cursor, "device_hash", device_hash)
        if grant is None:
            return "invalid_grant", None
        verdict, kept = poll(grant, now)
        if kept is None:
            cursor.execute(database.sql("DELETE FROM relay_signin_grants WHERE device_hash = ?"), (device_hash,))
        else:
            cursor.execute(
                database.sql("UPDATE relay_signin_grants SET last_poll = ?, poll_interval = ? WHERE device_hash = ?"),
                (kept.last_poll, kept.interval, device_hash),
            )
        if verdict == APPROVED and grant.idp_refresh is not None and refresh is not None:
            _insert_refresh(database, cursor, refresh[0], grant.identity, grant.idp_refresh, refresh[1])
        return verdict, grant

    return database.run(run)


def _insert_refresh(database, cursor, token_hash: str, identity: dict, idp_refresh: str, expires_at: float) -> None:
    cursor.execute(
        database.sql("INSERT INTO relay_signin_refresh (token_hash, identity, idp_refresh, expires_at) VALUES (?, ?, ?, ?)"),
        (token_hash, json.dumps(identity), idp_refresh, expires_at),
    )


def refresh_of(database, token_hash: str, now: float) -> tuple[dict, str] | None:
    """The identity and sealed provider refresh token a live refresh token holds, or ``None``."""

    def select(connection):
        cursor = connection.cursor()
        cursor.execute(
            database.sql("SELECT identity, idp_refresh FROM relay_signin_refresh WHERE token_hash = ? AND expires_at > ?"),
            (token_hash, now),
        )
        row = cursor.fetchone()
        return None if row is None else (json.loads(row[0]), row[1])

    return database.run(select)


def rotate_refresh(
    database, old_hash: str, new_hash: str, identity: dict, idp_refresh: str, expires_at: float
) -> bool:
    """Replace a refresh token by a new one; ``False`` (and nothing kept) when the old one was used or revoked meanwhile."""

    def rotate(connection):
        cursor = connection.cursor()
        cursor.execute(database.sql("DELETE FROM relay_signin_refresh WHERE token_hash = ?"), (old_hash,))
        if cursor.rowcount != 1:
            return False
        _insert_refresh(database, cursor, new_hash, identity, idp_refresh, expires_at)
        return True

    return database.run(rotate)


def delete_refresh(database, token_hash: str) -> bool:
    """Forget a refresh token (revoked, or refused by the provider); whether there was one."""

    def delete(connection):
        cursor = connection.cursor()
        cursor.execute(database.sql("DELETE FROM relay_signin_refresh WHERE token_hash = ?"), (token_hash,))
        return cursor.rowcount == 1

    return database.run(delete)


def revoke(database, jti: str, expires_at: float) -> None:
    """Revoke the session token ``jti`` until it expires."""

    def insert(connection):
        connection.cursor().execute(
            database.sql("INSERT INTO relay_signin_revoked (jti, expires_at) VALUES (?, ?) ON CONFLICT DO NOTHING"),
            (jti, expires_at),
        )

    database.run(insert)


def revocations(database, now: float, prune: bool = False) -> dict[str, float]:
    """
    Every session token revoked and not yet expired (``jti`` -> ``exp``);
    with ``prune``, what has ended in the three tables is deleted first.
    """

    def select(connection):
        cursor = connection.cursor()
        if prune:
            for table in ("relay_signin_revoked", "relay_signin_refresh", "relay_signin_grants"):
                cursor.execute(database.sql("DELETE FROM %s WHERE expires_at <= ?" % (table,)), (now,))
        cursor.execute(database.sql("SELECT jti, expires_at FROM relay_signin_revoked WHERE expires_at > ?"), (now,))
        return {jti: float(expires_at) for jti, expires_at in cursor.fetchall()}

    return database.run(select)
