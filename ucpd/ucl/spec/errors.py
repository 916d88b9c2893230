"""Errors of the spec language: where in a spec file a problem is, and what a rank's
parameters disagree with.

:class:`SpecError` is a malformed spec (syntax, unknown symbol, bad option): its message starts
with ``file:line:col:`` and shows the line with a caret under the column. :class:`SpecMismatch`
is a spec that does not fit a rank's parameters (a name no rule matches, a rule that matched
nothing, a shape the rule disagrees with), naming the parameters and the rules.
"""

from __future__ import annotations

from ...errors import InvalidPlacement, PlacementMismatch


class SpecError(InvalidPlacement):
    """A spec (file or text form) is malformed. ``source``, ``line`` and ``col`` (1-based) say
    where, when known; ``reason`` is the message without the location."""

    def __init__(
        self,
        reason: str,
        *,
        source: str | None = None,
        line: int | None = None,
        col: int | None = None,
        snippet: str | None = None,
    ):
        self.reason, self.source, self.line, self.col, self.snippet = reason, source, line, col, snippet
        where = source or "<spec>"
        if line is not None:
            where += f":{line}" + (f":{col}" if col is not None else "")
        msg = f"{where}: {reason}"
        if snippet is not None and col is not None:
            msg += f"\n    {snippet}\n    {' ' * (col - 1)}^"
        super().__init__(msg)


class TextError(SpecError):
    """A problem inside one piece of text form (a rule, an expression, a pattern) at character
    ``offset``. Loaders re-raise it as a :class:`SpecError` at the file position."""

    def __init__(self, reason: str, offset: int, text: str):
        self.offset, self.text = offset, text
        line = text.count("\n", 0, offset) + 1
        start = text.rfind("\n", 0, offset) + 1
        end = text.find("\n", offset)
        snippet = text[start : end if end >= 0 else len(text)]
        super().__init__(reason, source="<text>", line=line, col=offset - start + 1, snippet=snippet)


class SpecMismatch(PlacementMismatch):
    """A spec does not fit a rank's parameters. ``problems`` lists every problem found (one
    line each); ``unmatched``, ``unused`` and ``shapes`` break them down."""

    def __init__(self, summary: str, problems: list[str], *, unmatched=(), unused=(), shapes=()):
        self.problems = list(problems)
        self.unmatched, self.unused, self.shapes = list(unmatched), list(unused), list(shapes)
        shown = problems[:20]
        more = len(problems) - len(shown)
        body = "\n".join("  " + p for p in shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(f"{summary}:\n{body}")
