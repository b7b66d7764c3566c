"""What is on disk: pure data, never opens a file."""
