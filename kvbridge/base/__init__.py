"""The base layer: errors, value types, options, the wire format, the secret, the slow line and the watchdog."""
