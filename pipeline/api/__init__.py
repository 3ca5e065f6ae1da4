"""What every HTTP server of the runtime shares (the worker, the gateway, the route gate)."""
