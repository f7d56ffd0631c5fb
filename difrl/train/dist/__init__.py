"""Distribution over processes: FSDP2 sharding, the sharded training step, gathering a sharded network's units."""
