"""The local run and the CLI (`omni-pipeline`): `up` starts a pipeline's stages as processes on
this machine, `validate` runs the offline check, `status` prints the transfer table."""
