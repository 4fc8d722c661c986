"""`-tp N`: a target sharded over ranks of torch.distributed: the ranks and their collectives (comm), the weights
cut per rank (shard), and rank 0's driving context with the followers' loop (tensor_parallel)."""
