"""
The metrics say what the relay did (requests by route and status, ids
rewritten, repairs), in memory; ``GET /metrics`` serves them, on real
sockets.
"""

from __future__ import annotations

import os

import treq
from prometheus_client import generate_latest
from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import SynchronousTestCase, TestCase

from twisted_relay.config import RelayConfig, one_upstream
from twisted_relay.simulated import SimulatedUpstream

from tests.helpers import UPSTREAM_URL, InMemoryRelay, messages_body, serve_relay_over_simulated


class MetricsTests(SynchronousTestCase):
    """
    The metrics say what the relay did: requests by route and status, ids
    rewritten, repairs.
    """

    def test_rewrites_and_requests_counted(self):
        """
        A streamed answer whose id collides with the history is counted as a
        rewrite, and the request as a 200 on the messages route.
        """
        clock = MemoryReactorClock()
        sim = SimulatedUpstream(mode="strict", seed=2, reuse_every=1, reactor=clock)
        relay = InMemoryRelay(
            sim.resource(), RelayConfig(listen=(), upstreams=one_upstream(UPSTREAM_URL), dump_dir=None), clock=clock
        )
        history = [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA",
                        "name": "get_weather",
                        "input": {},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_01AAAAAAAAAAAAAAAAAAAAAA", "content": "ok"}
                ],
            },
        ]
        d = relay.post("/v1/messages", messages_body(history, stream=True))
        # The request reaches the relay, which sends it upstream (not answered yet).
        relay.network.flush()
        during = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn("relay_active_requests 1.0", during)
        relay.flush()
        response = self.successResultOf(d)
        body = response.content()
        relay.flush()
        text = self.successResultOf(body).decode()
        self.assertIn("toolu_01AAAAAAAAAAAAAAAAAAAAAA-2", text)
        exposition = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn('relay_ids_rewritten_total{block_type="tool_use"} 1.0', exposition)
        self.assertIn('relay_requests_total{route="messages",status="200"} 1.0', exposition)
        self.assertIn("relay_active_streams 0.0", exposition)
        self.assertIn("relay_active_requests 0.0", exposition)

    def test_repairs_counted(self):
        """
        A raw duplicate in the client's history, repaired on the way up, is
        counted.
        """
        relay = InMemoryRelay(SimulatedUpstream(mode="strict", seed=2).resource())
        use = {"type": "tool_use", "id": "toolu_dup", "name": "get_weather", "input": {}}
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "1"}],
            },
            {"role": "assistant", "content": [dict(use)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_dup", "content": "2"}],
            },
        ]
        d = relay.post("/v1/messages", messages_body(history))
        relay.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        exposition = generate_latest(relay.app.metrics.registry).decode()
        self.assertIn("relay_repairs_total 1.0", exposition)


class MetricsPageTests(TestCase):
    """``GET /metrics`` on real sockets."""

    def serve(self, **settings):
        served = serve_relay_over_simulated(self, "lenient", **settings)
        return served.port, served.relay

    async def test_metrics_page(self):
        """
        ``GET /metrics`` serves Prometheus' text format; ``--no-metrics``
        turns it off.
        """
        port, _ = self.serve()
        response = await treq.get("http://127.0.0.1:%d/metrics" % (port,), persistent=False)
        self.assertEqual(response.code, 200)
        self.assertIn(b"relay_requests_total", await response.content())
        port, _ = self.serve(metrics=False)
        response = await treq.get("http://127.0.0.1:%d/metrics" % (port,), persistent=False)
        self.assertEqual(response.code, 404)
        await response.content()


def _shared_files_after(testcase, script: str) -> str:
    """
    Run ``script`` in a process of its own, as a worker (its folder is
    ``sys.argv[1]``, its metrics go to a shared folder); the shared files'
    metrics in Prometheus' text format, as the script printed them.
    """
    import subprocess
    import sys

    folder = testcase.mktemp()
    shared = os.path.join(folder, "shared")
    os.makedirs(shared)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=shared)
    result = subprocess.run([sys.executable, "-c", script, folder], capture_output=True, env=env, timeout=60)
    testcase.assertEqual(result.returncode, 0, result.stderr.decode()[-2000:])
    return result.stdout.decode()


class UsageWithWorkersTests(SynchronousTestCase):
    """With workers, a process's usage tally is copied to the shared files by sync(), and summed."""

    def test_usage_reaches_the_shared_files(self):
        script = (
            "import os, sys\n"
            "from decimal import Decimal\n"
            "from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
            "from twisted_relay.metrics import RelayMetrics\n"
            "from twisted_relay.usage import TOKEN_KINDS, UsageRecord\n"
            "metrics = RelayMetrics()\n"
            "metrics.know_models(['claude-sonnet-4-5'])\n"
            "def record(output, partial):\n"
            "    tokens = dict.fromkeys(TOKEN_KINDS, 0)\n"
            "    tokens.update(input_tokens=10, output_tokens=output)\n"
            "    return UsageRecord(at=0.0, request_id='rly_1', key_name='alice', key_group='team', session_id=None,\n"
            "                       agent_id=None, parent_agent_id=None, upstream='default', model='claude-sonnet-4-5',\n"
            "                       status=200, stream=True, partial=partial, tokens=tokens, cost=Decimal('0.25'))\n"
            "metrics.count_usage(record(5, False))\n"
            "metrics.sync()\n"
            "metrics.count_usage(record(7, True))\n"
            "metrics.sync()\n"
            "metrics.sync()\n"
            "registry = CollectorRegistry()\n"
            "multiprocess.MultiProcessCollector(registry, os.environ['PROMETHEUS_MULTIPROC_DIR'])\n"
            "sys.stdout.write(generate_latest(registry).decode())\n"
        )
        text = _shared_files_after(self, script)
        # The shared files' collector sorts the labels.
        who, model = 'group="team",key="alice"', 'model="claude-sonnet-4-5"'
        for line in (
            'relay_usage_tokens_total{%s,kind="output",%s} 12.0' % (who, model),
            'relay_usage_tokens_total{%s,kind="input",%s} 20.0' % (who, model),
            'relay_usage_answers_total{complete="true",%s,%s,priced="true"} 1.0' % (who, model),
            'relay_usage_answers_total{complete="false",%s,%s,priced="true"} 1.0' % (who, model),
            'relay_usage_cost_usd_total{%s,%s} 0.5' % (who, model),
        ):
            self.assertIn(line, text)


class LedgerWithWorkersTests(SynchronousTestCase):
    """With workers, the usage ledger's figures are copied to the shared files by sync()."""

    def test_ledger_figures_reach_the_shared_files(self):
        script = (
            "import os, sys\n"
            "from decimal import Decimal\n"
            "from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
            "from twisted.internet import task\n"
            "from twisted.internet.defer import ensureDeferred\n"
            "from twisted_relay.ledger import Ledger\n"
            "from twisted_relay.ledger_sql import open_ledger\n"
            "from twisted_relay.metrics import RelayMetrics\n"
            "from twisted_relay.usage import TOKEN_KINDS, UsageRecord\n"
            "def record(n):\n"
            "    return UsageRecord(at=1796083200.0 + n, request_id='rly_%d' % n, key_name='alice', key_group=None,\n"
            "                       session_id=None, agent_id=None, parent_agent_id=None, upstream='default',\n"
            "                       model='claude-sonnet-4-5', status=200, stream=False, partial=False,\n"
            "                       tokens=dict.fromkeys(TOKEN_KINDS, 1), cost=Decimal('0.01'))\n"
            "async def main(reactor):\n"
            "    ledger = Ledger(open_ledger(os.path.join(sys.argv[1], 'usage.sqlite')), reactor=reactor,\n"
            "                    flush_interval=60, max_queue=3)\n"
            "    ledger.startService()\n"
            "    metrics = RelayMetrics()\n"
            "    metrics.watch_ledger(ledger)\n"
            "    for n in range(2):\n"
            "        ledger.record(record(n))\n"
            "    await ledger.flush()\n"
            "    metrics.sync()\n"
            "    for n in range(2, 6):\n"
            "        ledger.record(record(n))\n"
            "    metrics.sync()\n"
            "    registry = CollectorRegistry()\n"
            "    multiprocess.MultiProcessCollector(registry, os.environ['PROMETHEUS_MULTIPROC_DIR'])\n"
            "    sys.stdout.write(generate_latest(registry).decode())\n"
            "    await ledger.stopService()\n"
            "task.react(lambda reactor: ensureDeferred(main(reactor)))\n"
        )
        text = _shared_files_after(self, script)
        # Two written, three waiting (the queue's bound), one dropped.
        for line in (
            "relay_ledger_rows_written_total 2.0",
            "relay_ledger_rows_pending 3.0",
            "relay_ledger_rows_dropped_total 1.0",
            "relay_ledger_write_failures_total 0.0",
        ):
            self.assertIn(line, text)


class UsageTallyTests(SynchronousTestCase):
    """The usage tally is read by a scrape on the reactor's thread pool while the reactor counts."""

    def test_counting_while_a_scrape_reads(self):
        from decimal import Decimal

        from twisted_relay.metrics import _UsageTally
        from twisted_relay.usage import TOKEN_KINDS, UsageRecord

        def record(name):
            tokens = dict.fromkeys(TOKEN_KINDS, 0)
            tokens.update(input_tokens=3, cache_read_tokens=2)
            return UsageRecord(at=0.0, request_id="rly_1", key_name=name, key_group=None, session_id=None,
                               agent_id=None, parent_agent_id=None, upstream="default", model="m", status=200,
                               stream=False, partial=False, tokens=tokens, cost=Decimal("0.01"))

        tally = _UsageTally()
        tally.count(record("alice"), ("alice", "", "m"))
        reading = tally.samples()
        first = next(reading)
        # A new key and a new kind for a known one, counted mid-read.
        tally.count(record("bob"), ("bob", "", "m"))
        rest = list(reading)
        self.assertEqual(len([first, *rest]), 4)  # alice's answers, input, cache_read, cost
        self.assertEqual(len(list(tally.samples())), 8)
