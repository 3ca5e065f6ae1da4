"""Environments a rollout driver can play against a worker's chat endpoint."""
