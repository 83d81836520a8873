"""
Message threads (the API's ``thread`` field; ``--threads`` on the command
line): conversations the relay holds so that a client sends only its new
turn. Not Twisted's ``twisted.internet.threads``.

- :mod:`~twisted_relay.message_threads.model`: the pure model, no Twisted;
- :mod:`~twisted_relay.message_threads.store`: where conversations are kept
  (memory or Redis);
- :mod:`~twisted_relay.message_threads.turns`: one request's turn in a thread.

See ``docs/threads.md``.
"""
