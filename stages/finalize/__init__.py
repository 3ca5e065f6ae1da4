"""The finalizer stage: verify a receipt's rows and linearize them into one sample."""
