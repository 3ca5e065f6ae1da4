"""The vLLM adapter: ``AsyncLLM`` as a token engine, and the chat worker around it."""
