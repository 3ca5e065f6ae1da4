"""Hosting a consumer stage: the runner, recall of answered rollouts, metrics, lag.

Everything here is generic over ``stages.ports.StagePort``; which stages exist, and
what each reads and writes, is the table in ``stages.specs``.
"""
