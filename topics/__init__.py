"""The tokentrail data contract: records, events, digests, codec and topic names.

This package is the one thing every process agrees on. It imports nothing from
``stages`` or ``pipeline`` and no engine, tensor or Kafka library, so a trainer or
an auditor can depend on it alone.
"""
