"""Pure planning functions over flattened ``[start, end)`` element ranges; no I/O, no processes."""
