"""The tokentrail runtime: Kafka event log, embedded broker, TransferQueue data plane,
stage runner, worker server, CLI, configuration and metrics."""
