"""Rebuilding the token-free ledger from the event log, and the local store it goes to."""
