"""What may be in a job's name: no control characters and no lone
surrogates, which logs, terminals and worker file names cannot show or
hold. Checked where a name arrives: a request, or another node's notice."""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def has_control(text: str) -> bool:
    """Whether text holds a control character or a lone surrogate, which no
    job name holds."""
    return _CONTROL.search(text) is not None
