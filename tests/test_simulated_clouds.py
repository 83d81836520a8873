"""
The keyless first run on a simulated cloud (``twistd -n relay --simulate
bedrock``, ``vertex``, ``foundry``): the relay, as twistd starts it, sends
to the cloud on its wire with a login of the real kind (SigV4, a service
account through the token endpoint, an API key) and answers the official
SDK, streamed and not; ``/v1/models`` lists the model map.
"""

from __future__ import annotations

import time
import urllib.request

import ujson
from twisted.trial.unittest import SynchronousTestCase

from tests.helpers import free_port, start_twistd
from twisted_relay.settings import SIMULATED_CLOUDS
from twisted_relay.simulated.clouds import CLOUDS

try:
    import anthropic
except ImportError:  # pragma: no cover - the test extra installs it
    anthropic = None


class SimulatedCloudTests(SynchronousTestCase):
    def test_same_clouds(self):
        """The command line's list of clouds is the simulator's."""
        self.assertEqual(SIMULATED_CLOUDS, CLOUDS)

    def run_cloud(self, cloud: str) -> None:
        port = free_port()
        process, log = start_twistd(self, "-n", "--pidfile=", "relay", "--simulate", cloud, "--no-dumps",
                                    "--drain-delay", "0", "--listen", "tcp:%d:interface=127.0.0.1" % (port,))
        base = "http://127.0.0.1:%d" % (port,)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    with open(log) as f:
                        self.fail("the relay did not start:\n" + f.read())
                time.sleep(0.1)
        client = anthropic.Anthropic(base_url=base, api_key="sk-any", max_retries=0, timeout=30)
        self.addCleanup(client.close)
        request = dict(model="claude-opus-4-6", max_tokens=128, thinking={"type": "adaptive"},
                       messages=[{"role": "user", "content": "Say hello."}])
        message = client.messages.create(**request)
        self.assertEqual(message.role, "assistant")
        with client.messages.stream(**request) as events:
            streamed = events.get_final_message()
        self.assertEqual(streamed.stop_reason, message.stop_reason)
        listed = ujson.loads(urllib.request.urlopen(base + "/v1/models", timeout=5).read())
        self.assertIn("claude-opus-4-6", [model["id"] for model in listed["data"]])
        return message

    def test_bedrock(self):
        self.assertTrue(self.run_cloud("bedrock").id.startswith("msg_bdrk_"))

    def test_vertex(self):
        self.assertTrue(self.run_cloud("vertex").id.startswith("msg_vrtx_"))

    def test_foundry(self):
        self.run_cloud("foundry")
