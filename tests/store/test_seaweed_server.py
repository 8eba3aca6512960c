"""The SeaweedFS test server's readiness: ``start`` returns only once an object round trip
works (the S3 gateway answers a moment before the volume server serves), and the probe is
bounded: a server that never completes a round trip is reported, not waited on forever."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest

from kvpack.testing import seaweed as sw

pytestmark = pytest.mark.slow


def test_a_started_server_serves_a_put_get_round_trip_at_once(seaweed):
    t0 = time.monotonic()
    seaweed._wait_round_trip(time.monotonic() + 10)
    assert time.monotonic() - t0 < 10
    client = seaweed.client()
    listed = client.list_objects_v2(Bucket=sw.READY_BUCKET, Prefix="ready/").get("KeyCount", 0)
    assert listed == 0  # every probe removes its object


def test_the_round_trip_probe_gives_up_at_its_deadline(seaweed, tmp_path):
    wrong = copy.copy(seaweed)  # same server, a secret it does not know: every request refused
    wrong.credentials_file = os.path.join(tmp_path, "wrong.json")
    sw._write_private(wrong.credentials_file, json.dumps({"access_key_id": seaweed.access_key, "secret_access_key": "0" * 40}).encode())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="PUT\\+GET round trip"):
        wrong._wait_round_trip(time.monotonic() + 1.5)
    assert time.monotonic() - t0 < 15
    seaweed._wait_round_trip(time.monotonic() + 10)  # the server itself was left alone
