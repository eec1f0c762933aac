"""The transport contract (`MigrationBackend`), the built-in transports and what wraps any transport."""
