"""The work of tokentrail: capture, ledger, finalization and the rollout-driver client.

Stages depend only on ``topics`` and on the abstract ports in ``stages.ports``; the
runtime in ``pipeline`` supplies the Kafka and TransferQueue implementations.
"""
