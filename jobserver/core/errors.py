"""The error a command answers with."""


class CommandError(Exception):
    """Raised by a command: `status` is the whole reply status line, such as
    `404 No job with this jobID`. Raising it undoes the command's changes."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status
