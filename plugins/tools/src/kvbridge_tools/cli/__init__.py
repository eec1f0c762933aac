"""The `kvbridge` subcommands kvbridge-tools adds (entry-point group ``kvbridge.commands``)."""
