"""The tiers (compute device, CPU memory, disk) and the moves between them: the disk store under the
offload dir, the buffer pool, the I/O threads and their hand-offs, CUDA streams and pinned staging,
and weights placed by rows over the tiers."""
