"""graphar's collectives: the IPC custom all-reduce (allreduce) and the packed Ulysses exchanges."""
