"""The `kvbridge` subcommands kvbridge-tools adds (named by the `kvbridge_commands` hook of `kvbridge_tools.plugin`)."""
