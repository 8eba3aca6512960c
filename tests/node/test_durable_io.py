"""The decode node's durable tier on failing storage: the ladder plans a stored cut, and
restoring it fails with an I/O error (EIO here; an S3 server that does not answer within the
restore's deadline is the same ``io`` refusal). Nothing was installed, so the node plans the
request again without the store and recomputes it (a transfer from the producer): the same
tokens as without a store, the failure named in the result. Before, the ``io`` refusal
propagated out of the request and it failed."""

from __future__ import annotations

import os

from kvpack.node.receiver import ReceiverNode
from kvpack.store import PackStore
from kvpack.testing.faults import FaultyOps

from .test_nodes_arrays import PROMPT, Nodes, reference


class _StoreNodes(Nodes):
    store: PackStore | None = None

    def _receiver(self, advertised_port=None):
        return ReceiverNode(self.rcfg, self.engine, receipts_dir=self.rdir, advertised_port=advertised_port, check_volume=False, store=type(self).store).start()


def test_a_durable_restore_failing_with_io_is_recomputed_without_the_store(tmp_path):
    path = str(tmp_path / "rstore")
    healthy = PackStore.init(path)
    s = _StoreNodes
    s.store = healthy
    n = s(tmp_path / "n")
    try:
        first = n.receiver.generate(PROMPT, 8, save=True)
        assert healthy.find_deepest(PROMPT, n.engine.layout, n.engine.ids()) is not None, first.get("saved")
        n.receiver.stop()
        # a fresh receiver (nothing resident) whose store fails every chunk read
        s.store = PackStore.open(path, ops=FaultyOps(fail_reads=lambda kind, p: kind == "read" and "/chunks/" in p))
        n.receiver = n._receiver()
        res = n.receiver.generate(PROMPT, 8)
        assert (res["tokens"], res["logits_sha256"]) == reference(n.engine, PROMPT)
        assert res["plan"]["tier"] != "durable", res["plan"]
        assert len(res["durable_unreadable"]) == 1 and "Input/output error" in res["durable_unreadable"][0]
        assert not os.listdir(os.path.join(path, "quarantine"))  # a failing disk is not damage
    finally:
        s.store = None
        n.stop()
