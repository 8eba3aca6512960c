"""Disaggregated prefill between two real vLLM processes through kvpack (loopback, mTLS).

The test plays vLLM's P/D proxy: the prompt goes to the producer with ``max_tokens: 1`` and
``do_remote_decode``; the producer's ``kv_transfer_params`` go with the prompt to the
consumer, which fetches the prefix as a sealed Handoff V2 transfer (control plane to the
producer, data plane back) and decodes. The consumer's data address is a relay the test
controls, so a transfer can be tampered with on the wire.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvpack.security.enroll import Cluster
from kvpack.testing.vllm_harness import stop_all

from .conftest import MAX_TOKENS, engine_config, start

pytestmark = pytest.mark.slow


def _free_port() -> int:
    from kvpack.testing.ports import free_port

    return free_port()


@pytest.fixture(scope="module")
def relay():
    from node.helpers import Proxy  # tests/node/helpers.py: the loopback relay that can flip a bit

    port = _free_port()
    proxy = Proxy(port)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def cluster(vllm_py, smollm2_dir, reference, relay, tmp_path_factory):
    """Enroll a producer and a consumer under the identity of these engine arguments."""
    root = tmp_path_factory.mktemp("vllm-pd")
    ident = root / "identity.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0")
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("kvpack").__file__)))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [vllm_py, "-m", "kvpack.integrations.vllm", "identity", "--model", smollm2_dir, "--dtype", "float32", "--max-model-len", "4096", "-o", str(ident)]
    subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cl = Cluster.init(str(root / "cluster"), identity=json.loads(ident.read_text()))
    cl.enroll_node("decode-a", "receiver", listen=f"127.0.0.1:{relay.target_port}")
    cl.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{_free_port()}")
    return cl


@pytest.fixture(scope="module")
def pd(cluster, smollm2_dir, relay, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-pd-logs")
    # the producer hands finished prefills off in the steps after them: vLLM's engine-core
    # process runs those (an in-process offline engine steps only for its caller)
    producer = start(
        engine_config(
            smollm2_dir, "kvpack", kv_role="kv_producer", single_process=False, extra={"kvpack.node_config": cluster.producer_config_path("prefill-a")}
        ),
        logs,
        "producer",
        core=0,
    )
    consumer = start(
        engine_config(
            smollm2_dir,
            "kvpack",
            kv_role="kv_consumer",
            extra={"kvpack.node_config": cluster.receiver_config_path("decode-a", "prefill-a"), "kvpack.advertised_port": relay.port},
        ),
        logs,
        "consumer",
        core=1,
    )
    yield producer, consumer
    stop_all(producer, consumer)


def _handoff(producer, consumer, prompt):
    (pre,) = producer.generate([prompt], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params and params.get("do_remote_prefill") and params["kvpack"]["prompt_tokens"] == len(prompt)
    (out,) = consumer.generate([prompt], max_tokens=MAX_TOKENS, kv_transfer_params=params)
    return out


def _flush_stats(engine) -> None:
    """Connector stats travel with a worker's step output: the producer's handoff ran after
    its last step, so one more (tiny) request brings its counters to the metrics."""
    engine.generate([[1, 2, 3]], max_tokens=1)


def _receipts(cluster, node: str) -> list[dict]:
    d = os.path.join(cluster.node_dir(node), "receipts")
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if not name.endswith(".json"):
            continue  # the aggregated refusal log sits beside the receipts
        with open(os.path.join(d, name)) as fh:
            out.append(json.load(fh))
    return out


def test_the_consumer_decodes_the_handed_off_prefix_with_the_reference_tokens(pd, prompts, reference, cluster):
    producer, consumer = pd
    out = _handoff(producer, consumer, prompts["D"])
    assert out["tokens"] == reference["D"]
    _flush_stats(producer)
    mc, mp = consumer.metrics(), producer.metrics()
    assert mc.get("kvpack_transfers_received") == 1 and mp.get("kvpack_transfers_sent") == 1
    assert mc.get("kvpack_loaded_tokens") == len(prompts["D"]) - 1  # the consumer computed only the last token
    assert mc.get("kvpack_refusals", 0) == 0
    committed = [r for r in _receipts(cluster, "decode-a") if r.get("verdict") == "committed"]
    assert len(committed) == 1 and committed[0]["position"] == len(prompts["D"]) - 1


def test_a_tampered_transfer_is_refused_and_the_consumer_recomputes(pd, prompts, reference, cluster, relay):
    producer, consumer = pd
    before = consumer.metrics()
    relay.flip_at = relay.up + 3_000_000  # inside the first tile, after the TLS handshake
    relay.flipped = False
    out = _handoff(producer, consumer, prompts["D"])
    after = consumer.metrics()
    assert relay.flipped
    assert out["tokens"] == reference["D"]
    assert after.get("kvpack_refusals", 0) - before.get("kvpack_refusals", 0) == 1
    assert after.get("kvpack_transfers_received") == before.get("kvpack_transfers_received")
    assert after.get("kvpack_loaded_tokens") == before.get("kvpack_loaded_tokens")  # nothing was installed
    refused = [r for r in _receipts(cluster, "decode-a") if r.get("verdict") == "refused"]
    assert refused  # the receiver's receipt names the refusal
