"""Which broker a process talks to, where its config does not say (``--broker-kind auto``).

The embedded broker names every cluster it runs ``tokentrail-…``; Kafka names its own
with a base64 UUID. So a client asks the cluster id (Metadata) once, before it starts,
and takes the embedded broker's profile for such an id and Kafka's for any other.
"""

from __future__ import annotations

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


async def broker_of(config: KafkaConfig) -> BrokerProfile:
    """The profile of ``config``'s broker: as given, or asked of the broker."""
    if config.broker is not None:
        return config.broker
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    try:
        await admin.start()
        return await cluster_profile(admin)
    finally:
        await admin.close()
