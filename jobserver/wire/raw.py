"""Text that is already valid JSON, for jsonbody's replies.

A module of its own so that jsonbody can be compiled by mypyc (setup.py):
a compiled class cannot subclass str, an interpreted one can, and compiled
code still tells it apart with isinstance.
"""


class Raw(str):
    """Text that is already valid JSON."""
