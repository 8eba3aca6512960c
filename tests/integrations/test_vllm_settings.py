"""The connector's configuration keys: typos and wrong types refuse to start (a misspelled key
must never silently turn verification or saving off)."""

from __future__ import annotations

import pytest

from kvpack.errors import SecurityError
from kvpack.integrations.vllm.settings import Settings


def test_defaults_and_typed_values():
    s = Settings.from_extra("kv_both", {"kvpack.store": "/s", "kvpack.save_wait_s": 5, "other.key": 1})
    assert (s.store, s.save, s.save_wait_s, s.threads) == ("/s", "async", 5.0, 2)
    p = Settings.from_extra("kv_producer", {"kvpack.node_config": "/n/producer.json", "kvpack.transfer_wait_s": 2.5})
    assert p.node_config == "/n/producer.json" and p.store is None


@pytest.mark.parametrize(
    "role, extra",
    [
        ("kv_both", {}),  # no store
        ("kv_both", {"kvpack.store": "/s", "kvpack.stroe": "/t"}),  # typo
        ("kv_both", {"kvpack.store": "/s", "kvpack.save": "sometimes"}),
        ("kv_both", {"kvpack.store": "/s", "kvpack.threads": "2"}),
        ("kv_both", {"kvpack.store": "/s", "kvpack.threads": True}),
        ("kv_both", {"kvpack.store": "/s", "kvpack.threads": 0}),
        ("kv_consumer", {"kvpack.store": "/s"}),  # no node config
        ("kv_producer", {"kvpack.node_config": "/n", "kvpack.transfer_wait_s": 0}),
        ("kv_lookup", {"kvpack.store": "/s"}),
        (None, {"kvpack.store": "/s"}),
    ],
)
def test_unusable_configurations_refuse_to_start(role, extra):
    with pytest.raises(SecurityError) as exc:
        Settings.from_extra(role, extra)
    assert exc.value.category == "config"
