"""
OpenAI's protocols as the relay speaks them to an upstream (issue 33): the
Responses API and Chat Completions (with its dialects), translated from
and to Anthropic's Messages. Pure: no Twisted, no I/O, so that a body
worker process can translate a large request as it serialises it.
``envelope`` <- ``dialects`` <- ``responses``, ``chat``.
"""
