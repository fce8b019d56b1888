"""What tokenization raises: a model directory that cannot be used, a missing package, a chat
template that refused a conversation; and `one_line`, the one-line form of an exception the
operator reads."""

from __future__ import annotations

__all__ = ["TemplateError", "TokenizerError", "TokenizerUnavailable", "one_line"]


class TokenizerError(ValueError):
    """The model directory cannot be used; the message is one line for the operator."""


class TokenizerUnavailable(TokenizerError):
    """A package tokenization needs (`tokenizers`, `jinja2`) is not installed."""

    def __init__(self, package: str) -> None:
        super().__init__(f"tokenization needs the '{package}' package")
        self.package = package


class TemplateError(ValueError):
    """A chat template failed to render (its `raise_exception(...)`, or a jinja2 error)."""


def one_line(exc: BaseException) -> str:
    """`exc` as one line: its `strerror` (an OSError) or its text, whitespace folded."""
    text = str(getattr(exc, "strerror", None) or exc)
    return " ".join(text.split()) or type(exc).__name__
