"""The vLLM adapter: capture attached to vLLM's serving layers (renderer, engine client, scope)."""
