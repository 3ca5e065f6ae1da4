"""Which broker a process talks to, where its config does not say (``--broker-kind auto``).

The embedded broker names every cluster it runs ``tokentrail-…``; Kafka names its own
with a base64 UUID. So a client asks the cluster id (Metadata) once, before it starts,
and takes the embedded broker's profile for such an id and Kafka's for any other.
"""

from __future__ import annotations

import dataclasses

from aiokafka.admin import AIOKafkaAdminClient

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.tansu import EMBEDDED_CLUSTER_PREFIX, TANSU
from pipeline.kafka.profile import KAFKA, BrokerProfile


def profile_of_cluster(cluster_id: str | None) -> BrokerProfile:
    """The profile of a broker whose cluster id is ``cluster_id`` (None: it named none)."""
    if cluster_id is not None and cluster_id.startswith(EMBEDDED_CLUSTER_PREFIX):
        return TANSU
    return KAFKA


async def cluster_profile(admin: AIOKafkaAdminClient) -> BrokerProfile:
    """Ask the cluster behind a started admin client what it is."""
    cluster = (await admin.describe_cluster()).get("cluster_id")
    return profile_of_cluster(cluster if isinstance(cluster, str) else None)


async def known_broker(config: KafkaConfig) -> KafkaConfig:
    """``config`` with its broker's profile: as given, or asked of the broker."""
    if config.broker is not None:
        return config
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    try:
        await admin.start()
        profile = await cluster_profile(admin)
    finally:
        await admin.close()
    return dataclasses.replace(config, broker=profile)
