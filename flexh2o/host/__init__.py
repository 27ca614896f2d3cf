"""The machine a run is on and its limits: CPU and GPU facts, the device and dtype defaults, memory
limits (cgroups, --max-memory), the process's own growth, aligned memory for O_DIRECT, and the
hardware profiles the cost model reads."""
