"""The trio server: listening, connections, shutdown."""
