"""Feeding a training loop from the finalized topic, and the closed RL loop of ``tokentrail run``."""
