"""What a probe measures (memory, step time, host RSS, phases), how a run is classified, and the estimate beside it."""
