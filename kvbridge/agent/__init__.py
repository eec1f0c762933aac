"""One rank's registered KV cache and its reads (`KVAgent`), and where they land."""
