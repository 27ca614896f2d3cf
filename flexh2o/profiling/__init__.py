"""Measuring this machine into the hardware profile `local`: matrix products, attention, memory and
disk bandwidths, per-call overheads, the process's memory growth; cached and measured again when
it no longer describes the machine."""
