# Run with: twistd -ny docs/relay.tac
#
# An existing Twisted application that mounts twisted-relay under /relay/ in
# its own Site, beside its own pages, and parents the relay's service so the
# relay's upstream connection pools and dump writer start and stop with it.
#
# Two upstreams: Claude Code's small requests go to a self-hosted server
# first (Anthropic when it fails before answering), the rest to Anthropic.

from twisted.application import service, strports
from twisted.web.resource import Resource
from twisted.web.server import Site
from twisted.web.static import Data

from twisted_relay import Relay, RelayConfig
from twisted_relay.config import Route, Target, Upstream

application = service.Application("my-app")

config = RelayConfig(
    listen=(),  # the application serves; the relay does not listen itself
    upstreams=(
        Upstream("anthropic", "https://api.anthropic.com"),  # clients' own credentials pass through
        Upstream("local", "http://127.0.0.1:8000", ids="original", response_timeout=120.0),
    ),
    routes=(
        Route(
            models=("claude-haiku-*",),
            targets=(Target("local", model="qwen3-coder"), Target("anthropic")),
        ),
        Route(targets=(Target("anthropic"),)),
    ),
    dump_dir="relay-dumps",
)
relay = Relay(config)
relay.service.setServiceParent(application)

root = Resource()
root.putChild(b"", Data(b"my application\n", "text/plain"))
root.putChild(b"relay", relay.resource())  # clients use ANTHROPIC_BASE_URL=http://host:8000/relay

strports.service("tcp:8000:interface=127.0.0.1", Site(root)).setServiceParent(application)
