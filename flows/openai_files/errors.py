"""Why an OpenAI batch line cannot be served: the error every check of a line raises."""

from __future__ import annotations


class LineError(ValueError):
    """Why a line cannot be served: OpenAI's error `code` and the body `param` at fault."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
