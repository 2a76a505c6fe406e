"""What a job is, and its times and names: the bottom layer, which the core
and storage share; it imports neither."""
