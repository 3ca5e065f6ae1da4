"""The ledger stage: joins admissions with staged events into a token-free ledger and
turns each sealed rollout into one receipt."""
