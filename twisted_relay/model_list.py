# -*- test-case-name: tests.test_gateway_contract -*-
"""
The model list the relay answers itself (``GET /v1/models`` and
``GET /v1/models/{id}``), in the shape of Anthropic's Models API, for the
models its routes serve.

The relay answers itself when every route names its models (no route
takes any model): then no upstream knows the whole list, and an upstream's
own list would offer models no route serves. It lists the concrete ids the
routes' ``models`` name, in file order, never a glob (``claude-haiku-*``
is not a model id). A route that takes any model, or routes that name
only globs, leave the list to the upstream, as before (one upstream, no
model list): :func:`routed_model_ids` says ``None`` then.

Pure functions: no Twisted, no I/O.
"""

from __future__ import annotations

from twisted_relay._json import to_json
from twisted_relay.config import RelayConfig

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "model_body", "model_list_body", "routed_model_ids", "wire_model_ids"]

#: The page size when a client gives no ``limit`` (the API's default).
DEFAULT_LIMIT = 20
#: The largest page (the API's limit; Claude Code asks ``?limit=1000``).
MAX_LIMIT = 1000
# A release time the relay does not know: the epoch, as the API documents.
_UNKNOWN_RELEASE = "1970-01-01T00:00:00Z"
_GLOB_CHARACTERS = frozenset("*?[")


def routed_model_ids(config: RelayConfig) -> tuple[str, ...] | None:
    """
    The model ids the relay lists itself, in file order and each once, or
    ``None`` when the upstream answers (a route takes any model, or the
    routes name no concrete id).
    """
    if not config.routes or any(not route.models for route in config.routes):
        return None
    ids = []
    for route in config.routes:
        ids.extend(name for name in route.models if not _GLOB_CHARACTERS & set(name))
    return tuple(dict.fromkeys(ids)) or None


def wire_model_ids(config: RelayConfig, route) -> tuple[str, ...] | None:
    """
    The model ids the relay lists itself when ``route`` (the one that
    answers ``GET /v1/models``) sends it first to an upstream whose wire has
    no Models API (Bedrock, Vertex) or that has a model map (Foundry's
    deployments): the models every such upstream's model map names, in file
    order (``()`` when none names one); ``None`` when the upstream lists its
    own.
    """
    first = config.upstream_named(route.targets[0].upstream)
    if first.wire == "anthropic" and not first.models:
        return None
    ids = [asked for upstream in config.upstreams if upstream.wire != "anthropic" or upstream.models
           for asked, _ in upstream.models]
    return tuple(dict.fromkeys(ids))


def _model(model_id: str) -> dict:
    return {
        "type": "model",
        "id": model_id,
        "display_name": model_id,
        "created_at": _UNKNOWN_RELEASE,
        "lifecycle": "active",
    }


def model_body(model_id: str) -> bytes:
    """One model's description (``GET /v1/models/{id}``)."""
    return to_json(_model(model_id))


def model_list_body(ids: tuple[str, ...], query: dict[bytes, list[bytes]]) -> bytes:
    """
    One page of the list, as the API pages it: ``limit`` (1 to 1000, 20 by
    default), ``after_id`` or ``before_id``; ``has_more``, ``first_id``,
    ``last_id``. An id the list does not hold pages from its start (after)
    or end (before). Other parameters are ignored.

    :param query: the request's query arguments (Twisted's ``request.args``).
    """
    limit = _limit(query)
    after = _first(query, b"after_id")
    before = _first(query, b"before_id")
    if before is not None:
        end = ids.index(before) if before in ids else len(ids)
        start = max(0, end - limit)
        page, has_more = ids[start:end], start > 0
    else:
        start = ids.index(after) + 1 if after in ids else 0
        page, has_more = ids[start : start + limit], start + limit < len(ids)
    return to_json(
        {
            "data": [_model(model_id) for model_id in page],
            "has_more": has_more,
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
        }
    )


def _first(query: dict[bytes, list[bytes]], name: bytes) -> str | None:
    values = query.get(name)
    return values[0].decode("utf-8", "replace") if values else None


def _limit(query: dict[bytes, list[bytes]]) -> int:
    text = _first(query, b"limit")
    try:
        limit = int(text) if text is not None else DEFAULT_LIMIT
    except ValueError:
        limit = DEFAULT_LIMIT
    return min(max(limit, 1), MAX_LIMIT)
