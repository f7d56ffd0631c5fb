"""The run's life: its directory and resume rules, checkpoints (gathered, sharded, their manifests), Ctrl-C / SIGTERM, the progress line."""
