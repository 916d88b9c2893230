"""Parameter-name patterns of spec rules: globs with captures, or regular expressions.

A glob matches the whole name: ``*`` any characters (dots included), ``?`` one character,
``{name}`` a captured non-negative integer (``layers.*.mlp.experts.{expert}.fc1.weight``).
A pattern starting with ``re:`` is a Python regular expression that must match the whole
name; its named groups are captures (``re:layers\\.\\d+\\.mlp\\.experts\\.(?P<expert>\\d+)\\..*``).

Captures hold integers (a layer or an expert index). :meth:`NamePattern.without` gives the
pattern of the names with one captured component removed: a stacked expert tensor's global
name has no expert index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import TextError

_CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Match:
    """A name matched by a pattern: ``captures`` maps capture names to (value, (start, end))."""

    name: str
    captures: dict[str, tuple[int, tuple[int, int]]] = field(default_factory=dict)

    def values(self) -> dict[str, int]:
        return {k: v for k, (v, _) in self.captures.items()}


@dataclass(frozen=True)
class NamePattern:
    """A compiled rule pattern. ``text`` is the pattern as written."""

    text: str
    regex: re.Pattern
    captures: tuple[str, ...]
    is_regex: bool

    def match(self, name: str) -> Match | None:
        m = self.regex.fullmatch(name)
        if m is None:
            return None
        caps = {}
        for k in self.captures:
            s = m.group(k)
            if s is None or not s.isdigit():
                return None  # a capture must hold an integer (ascii digits)
            caps[k] = (int(s), m.span(k))
        return Match(name, caps)

    def without(self, capture: str) -> "NamePattern":
        """The pattern with the component holding ``capture`` (and one adjacent dot) removed."""
        if self.is_regex:
            body = _drop_group(self.text[3:], capture)
            return compile_pattern("re:" + body)
        token = "{" + capture + "}"
        i = self.text.index(token)
        j = i + len(token)
        if j < len(self.text) and self.text[j] == ".":
            text = self.text[:i] + self.text[j + 1 :]
        elif i > 0 and self.text[i - 1] == ".":
            text = self.text[: i - 1] + self.text[j:]
        else:
            text = self.text[:i] + self.text[j:]
        return compile_pattern(text)


def compile_pattern(text: str) -> NamePattern:
    """Compile a glob (``layers.*.attn.qkv.weight``, captures ``{expert}``) or a ``re:`` regex.
    Raises TextError at the offending character."""
    if not isinstance(text, str) or not text:
        raise TextError("a rule pattern must be a non-empty string", 0, str(text))
    if text.startswith("re:"):
        try:
            rx = re.compile(text[3:])
        except re.error as exc:
            raise TextError(f"bad regular expression: {exc.msg}", 3 + (exc.pos or 0), text) from None
        return NamePattern(text, rx, tuple(rx.groupindex), True)
    out = []
    caps: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "{":
            m = _CAPTURE.match(text, i)
            if m is None:
                raise TextError("a capture is {name}, e.g. {expert}: a name in braces", i, text)
            if m.group(1) in caps:
                raise TextError(f"capture {m.group(1)!r} appears twice", i, text)
            caps.append(m.group(1))
            out.append(f"(?P<{m.group(1)}>[0-9]+)")
            i = m.end()
            continue
        elif c == "}":
            raise TextError("'}' without a matching '{'", i, text)
        else:
            out.append(re.escape(c))
        i += 1
    return NamePattern(text, re.compile("".join(out)), tuple(caps), False)


def drop_component(name: str, span: tuple[int, int]) -> str:
    """``name`` without the characters of ``span`` and one adjacent dot."""
    a, b = span
    if b < len(name) and name[b] == ".":
        return name[:a] + name[b + 1 :]
    if a > 0 and name[a - 1] == ".":
        return name[: a - 1] + name[b:]
    return name[:a] + name[b:]


def replace_component(name: str, span: tuple[int, int], value: int) -> str:
    return name[: span[0]] + str(value) + name[span[1] :]


def _drop_group(rx: str, capture: str) -> str:
    """Remove the named group ``capture`` (and an adjacent escaped dot) from a regex."""
    start = rx.find(f"(?P<{capture}>")
    if start < 0:
        return rx
    depth, i, in_class = 0, start, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                break
        i += 1
    end = i + 1
    if rx.startswith("\\.", end):
        end += 2
    elif rx.startswith(".", end):
        end += 1
    elif rx[:start].endswith("\\."):
        start -= 2
    return rx[:start] + rx[end:]
