"""The upstreams\x27 wires: how a request is sent to each kind of upstream and its answer read back as Anthropic\x27s."""
