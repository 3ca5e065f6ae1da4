"""The embedded broker: tansu supervised by tokentrail, its durable store, and its
deviations from Kafka (``tansu.TANSU``). Only single-machine runs, tests and benchmarks
run this code; a deployment on Kafka runs none of it."""
