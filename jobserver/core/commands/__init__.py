"""The commands: the dispatcher's table of routes, one module per family of
commands, the checks of their parameters and the views they reply with."""
