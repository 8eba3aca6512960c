"""Test support shipped with kvpack: fault-injecting file layer and helpers for crash tests."""
