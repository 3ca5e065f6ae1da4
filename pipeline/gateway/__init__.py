"""The gateway: black-box agents captured through a base URL."""
