"""What vLLM carries from the connector's scheduler side to its workers each step (the plan,
`KVWardenConnectorMetadata`) and back (`KVWardenWorkerMetadata`: the saves that are over)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from dataplane.client.vllm.state import Plan


class KVWardenConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: Plan) -> None:
        self.plan = plan


class KVWardenWorkerMetadata(KVConnectorWorkerMetadata):
    """A step's saves that are over (their sequence numbers, once per rank)."""

    def __init__(self, saved: list[int]) -> None:
        self.saved = saved

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVWardenWorkerMetadata)
        return KVWardenWorkerMetadata(self.saved + other.saved)
