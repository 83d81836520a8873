"""
``twistd relay``'s command line as a newcomer first meets it: ``--version``,
and ``--simulate`` starting from the standalone simulator's seed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from twisted.trial.unittest import SynchronousTestCase

from twisted_relay._version import __version__
from twisted_relay.simulated.cli import build_parser
from twisted_relay.tap import Options as TapOptions


class CommandLineTests(SynchronousTestCase):
    """What a newcomer trips on first: the version, the simulator's seed."""

    def test_version(self):
        """``twistd -n relay --version`` prints the relay's version (and Twisted's), and exits 0."""
        done = subprocess.run(
            [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "relay", "--version"],
            cwd=self.mktemp_dir(), capture_output=True, timeout=60, check=False,
        )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn(b"twisted-relay version: " + __version__.encode(), done.stdout)
        self.assertIn(b"Twisted version:", done.stdout)

    def mktemp_dir(self) -> str:
        path = self.mktemp()
        os.makedirs(path)
        return path

    def test_simulated_seeds_agree(self):
        """``--simulate`` and the standalone simulator start from the same seed by default."""
        options = TapOptions()
        options.parseOptions(["--simulate", "strict"])
        self.assertEqual(options.config.simulate_options["seed"], build_parser().parse_args([]).seed)
