"""Built-in transports: `tcp` (pure-Python reference) and `loopback` (in-process, fault injection)."""
