"""
Sign-in with the company's identity provider: the authorization server
Claude Code's gateway login speaks to (RFC 8414 metadata, the RFC 8628
device grant, refresh and RFC 7009 revocation), the browser step through
the company's OIDC provider, session tokens accepted wherever a relay key
is, and what a signed-in client asks of a gateway beside the Messages API
(managed settings, telemetry intake, the usage endpoint).
See ``docs/signin.md``.
"""
