"""The benchmarks (see docs/benchmarks.md); not a test suite, not run by CI."""
