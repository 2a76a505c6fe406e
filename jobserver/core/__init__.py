"""The job queue itself: lifecycle, commands, scheduling, waiting, group commit."""
