"""A job's life: the moves of its lifecycle, when it runs next, which jobs
a GetJob gets, and the limits and pauses that hold jobs back."""
