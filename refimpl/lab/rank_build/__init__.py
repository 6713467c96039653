"""The shard-only build: a rank made from a meta model, one parameter value at a time."""
