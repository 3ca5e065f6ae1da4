"""The gateway as a foreground process: publish through Kafka, say where it serves, and
serve until SIGTERM or SIGINT (what ``tokentrail gateway`` runs)."""

from __future__ import annotations

import json

from pipeline.gateway.main import GatewayConfig, run_gateway
from pipeline.kafka import KafkaEventSink
from pipeline.kafka.config import KafkaConfig


async def serve_gateway(config: GatewayConfig, kafka: KafkaConfig, *, as_json: bool) -> None:
    """Serve until stopped, publishing to ``kafka``; the one line on stdout says the
    gateway's URL once it serves."""

    def ready(url: str) -> None:
        if as_json:
            print(json.dumps({"url": url, "workers": list(config.workers)}, sort_keys=True), flush=True)
        else:
            print(f"gateway serving on {url} in front of {', '.join(config.workers)}", flush=True)

    async with KafkaEventSink(kafka) as sink:
        await run_gateway(config, sink, on_ready=ready)
