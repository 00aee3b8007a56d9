"""Pure metric functions (no torch, no I/O): usable by tasks, table scripts and tests alike."""
