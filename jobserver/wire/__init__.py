"""The text protocol on the wire: framing, escaping, limits; no I/O."""
