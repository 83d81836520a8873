"""The twisted-relay trial suite."""
