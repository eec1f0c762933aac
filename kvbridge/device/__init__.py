"""Device plugins' contract and the built-in devices: where a KV cache lives and how a transport reaches it."""
