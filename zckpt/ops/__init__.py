"""The operations (library functions behind the CLI commands): inspect, consolidate, reshard, diff, verify."""
