"""The version of twisted-relay, in one place."""

__version__ = "0.1.0"
