"""The Megatron-Core adapter: the engine's prompt-preparer and payload-stager hooks."""
