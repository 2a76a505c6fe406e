"""jobserver: a durable job queue speaking Bedrock::Jobs' text protocol."""

__version__ = "0.1.0"
