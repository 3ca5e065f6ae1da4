"""The capture worker as a foreground process: start the engine, attach to Kafka and the
data plane, say where it serves, and serve until SIGTERM or SIGINT (what ``tokentrail
worker`` runs)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.auth.transport import check_bind
from pipeline.dataplane import attach_data_plane
from pipeline.kafka import KafkaEventSink
from pipeline.kafka.config import KafkaConfig
from pipeline.worker.main import WorkerConfig, WorkerServer, run_worker
from stages.capture.vllm.engine import VllmEngine


async def serve_worker(
    config: WorkerConfig, kafka: KafkaConfig, dataplane_addresses: Path | None, *, as_json: bool
) -> None:
    """Serve until stopped; the one line on stdout says the worker's URL once it serves."""
    check_bind(config.host, config.credentials, insecure_no_auth=config.insecure_no_auth, what="worker")

    def ready(server: WorkerServer) -> None:
        if as_json:
            document = {
                "url": server.url,
                "port": server.port,
                "worker_id": config.worker_id,
                "model": config.model_name,
                "ack": config.ack_policy.value,
            }
            print(json.dumps(document, sort_keys=True), flush=True)
        else:
            print(f"worker {config.worker_id} serving {config.model_name} on {server.url}", flush=True)

    # The engine first: it takes tens of seconds and blocks the loop while it starts,
    # which must not happen under a live Kafka producer or data-plane client.
    engine = VllmEngine.start(config.engine_settings())
    try:
        async with KafkaEventSink(kafka) as sink, attach_data_plane(dataplane_addresses) as plane:
            await run_worker(config, data_plane=plane, sink=sink, engine=engine, on_ready=ready, kafka=kafka)
    finally:
        engine.shutdown()
