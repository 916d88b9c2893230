"""The text form of UCL patterns: tokenizer, recursive-descent parser, syntax tree, printer and
the evaluation of expressions.

Grammar (whitespace is free)::

    rule      := placement [":" shape]            # shape: the GLOBAL shape, checked
    shape     := "[" [expr ("," expr)*] "]"
    placement := KIND ["(" [arg ("," arg)*] ")"]
    arg       := [NAME "="] (placement | list | expr)
    list      := "[" [arg ("," arg)*] "]"
    expr      := and ("or" and)*
    and       := not ("and" not)*
    not       := "not" not | cmp
    cmp       := sum [("==" | "!=" | "<" | "<=" | ">" | ">=") sum]
    sum       := term (("+" | "-") term)*
    term      := unary (("*" | "/" | "//" | "%") unary)*
    unary     := "-" unary | atom
    atom      := NUMBER | NAME | FUNC "(" expr ("," expr)* ")" | "(" expr ")"

KIND is one of ``replicated average shard box fused padded stacked``; FUNC one of ``min max
cdiv``. ``/`` must divide exactly (an error otherwise), ``//`` floors, ``cdiv`` rounds up;
comparisons and ``and``/``or``/``not`` give 1 or 0.

Placements (``docs/UCL.md``, "Spec files"): ``replicated``; ``average(axis)`` (replicated,
averaged over ``axis`` on consolidation); ``shard(dim, axis[, max=n])`` and ``shard(dim, index,
parts)``; ``box([offsets], [lengths], [global_shape])``; ``fused(dim, [label=size, ...] | n,
inner | [inner, ...])``; ``padded(dim, logical[, inner][, value=v])``; ``stacked(dim, axis[,
inner][, count=n][, by=capture])`` and ``stacked(dim, index=i, count=n[, inner])``.

Every node records ``pos``, its character offset in the text (not part of equality), so that
errors found later (at binding or resolution) still point at the column.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from .errors import TextError

KINDS = ("replicated", "average", "shard", "box", "fused", "padded", "stacked")
FUNCS = ("min", "max", "cdiv")
KEYWORDS = ("and", "or", "not")

# --------------------------------------------------------------------------------------------
# tokens

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<num>\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\d+|\.\d+(?:[eE][-+]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>//|==|!=|<=|>=|[-+*/%()\[\],=:<>])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str  # "num" | "name" | "op" | "end"
    value: str
    pos: int


def tokenize(text: str) -> list[Token]:
    """Split ``text`` into tokens; an unexpected character raises TextError at its column."""
    out: list[Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TextError(f"unexpected character {text[pos]!r}", pos, text)
        if m.lastgroup != "ws":
            out.append(Token(m.lastgroup or "", m.group(), pos))
        pos = m.end()
    out.append(Token("end", "", len(text)))
    return out


# --------------------------------------------------------------------------------------------
# expressions


@dataclass(frozen=True)
class Num:
    value: int | float
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Name:
    id: str
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Unary:
    op: str  # "-" | "not"
    operand: "Expr"
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Binary:
    op: str
    left: "Expr"
    right: "Expr"
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Func:
    name: str
    args: tuple["Expr", ...]
    pos: int = field(default=0, compare=False)


Expr = Union[Num, Name, Unary, Binary, Func]

_PREC = {"or": 1, "and": 2, "not": 3, "==": 4, "!=": 4, "<": 4, "<=": 4, ">": 4, ">=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "//": 6, "%": 6, "neg": 7}


class EvalError(Exception):
    """An expression cannot be evaluated: ``reason`` at character ``pos`` of its text."""

    def __init__(self, reason: str, pos: int):
        super().__init__(reason)
        self.reason, self.pos = reason, pos


def names_in(node: Any) -> list[Name]:
    """Every Name node in an expression or placement tree, in text order."""
    out: list[Name] = []

    def walk(n: Any) -> None:
        if isinstance(n, Name):
            out.append(n)
        elif isinstance(n, (tuple, list)):
            for x in n:
                walk(x)
        elif hasattr(n, "__dataclass_fields__"):
            for f in n.__dataclass_fields__:
                if f != "pos":
                    walk(getattr(n, f))

    walk(node)
    return out


def evaluate(e: Expr, env: Mapping[str, int | float]) -> int | float:
    """The value of ``e`` with names from ``env``. Raises EvalError (unknown name, a ``/`` that
    does not divide, division by zero)."""
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Name):
        if e.id not in env:
            raise EvalError(f"symbol {e.id!r} is not bound", e.pos)
        return env[e.id]
    if isinstance(e, Unary):
        v = evaluate(e.operand, env)
        return -v if e.op == "-" else int(not v)
    if isinstance(e, Func):
        vals = [evaluate(a, env) for a in e.args]
        if e.name == "min":
            return min(vals)
        if e.name == "max":
            return max(vals)
        a, b = vals
        if b == 0:
            raise EvalError("cdiv by zero", e.pos)
        return -(-a // b)
    op = e.op
    if op == "and":
        return int(bool(evaluate(e.left, env)) and bool(evaluate(e.right, env)))
    if op == "or":
        return int(bool(evaluate(e.left, env)) or bool(evaluate(e.right, env)))
    a, b = evaluate(e.left, env), evaluate(e.right, env)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op in ("/", "//", "%") and b == 0:
        raise EvalError(f"division by zero in {format_expr(e)}", e.pos)
    if op == "/":
        if isinstance(a, int) and isinstance(b, int):
            if a % b:
                raise EvalError(f"{format_expr(e)} = {a} / {b} is not a whole number", e.pos)
            return a // b
        return a / b
    if op == "//":
        return a // b
    if op == "%":
        return a % b
    return int({"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def format_expr(e: Expr, parent: int = 0) -> str:
    """Canonical text of an expression (parenthesized only where precedence needs it)."""
    if isinstance(e, Num):
        return repr(e.value)
    if isinstance(e, Name):
        return e.id
    if isinstance(e, Func):
        return f"{e.name}(" + ", ".join(format_expr(a) for a in e.args) + ")"
    if isinstance(e, Unary):
        prec = _PREC["neg" if e.op == "-" else "not"]
        text = ("-" if e.op == "-" else "not ") + format_expr(e.operand, prec)
    else:
        prec = _PREC[e.op]
        # left-associative: the right operand needs parens at equal precedence
        text = f"{format_expr(e.left, prec)} {e.op} {format_expr(e.right, prec + 1)}"
    return f"({text})" if prec < parent else text


# --------------------------------------------------------------------------------------------
# placements


@dataclass(frozen=True)
class PReplicated:
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PAverage:
    """Replicated in UCL; its replicas are averaged over ``axis`` on consolidation (metadata)."""

    axis: Name
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PShard:
    """``shard(dim, axis[, max=n])`` (axis form) or ``shard(dim, index, parts)``."""

    dim: Expr
    axis: Name | None = None
    index: Expr | None = None
    parts: Expr | None = None
    max: Expr | None = None
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PBox:
    offsets: tuple[Expr, ...]
    lengths: tuple[Expr, ...]
    shape: tuple[Expr, ...]
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PFused:
    """``sizes``: ((label or None, global size), ...), or None with ``count`` equal parts whose
    sizes come from the local shape. ``inner``: one placement or a tuple, one per sub-tensor."""

    dim: Expr
    sizes: tuple[tuple[str | None, Expr], ...] | None
    count: Expr | None
    inner: Any
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PPadded:
    dim: Expr
    logical: Expr
    inner: Any = PReplicated()
    value: Expr | None = None
    pos: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PStacked:
    """``stacked(dim, axis, ...)``: item ``axis_rank * (count / axis) + <capture>``; or an
    explicit ``index``. ``by`` names the capture (default: ``expert``, or the pattern's only
    capture); ``count`` defaults to the symbol ``experts``."""

    dim: Expr
    axis: Name | None = None
    inner: Any = PReplicated()
    count: Expr | None = None
    index: Expr | None = None
    by: Name | None = None
    pos: int = field(default=0, compare=False)


PNode = Union[PReplicated, PAverage, PShard, PBox, PFused, PPadded, PStacked]

_PNODES = (PReplicated, PAverage, PShard, PBox, PFused, PPadded, PStacked)


def walk_placement(p: Any) -> Iterator[PNode]:
    """A placement node and all its inner placement nodes."""
    if isinstance(p, tuple):
        for x in p:
            yield from walk_placement(x)
        return
    if not isinstance(p, _PNODES):
        return
    yield p
    inner = getattr(p, "inner", None)
    if inner is not None:
        yield from walk_placement(inner)


@dataclass(frozen=True)
class RuleText:
    """A parsed rule: the placement and, optionally, the global shape it must produce."""

    placement: PNode
    shape: tuple[Expr, ...] | None = None


# --------------------------------------------------------------------------------------------
# printer


def _print(p: Any, expr: Callable[[Expr], str], axis: Callable[[Name], str], canonical: bool) -> str:
    """The one printer of a placement (or a value inside one: a list, an expression), with
    ``expr`` and ``axis`` printing its leaves. ``canonical``: text that parses back (a
    ``replicated`` inner left out, as the parser fills it in; anything else raises TypeError);
    else every part is shown and what is no node is printed as it is."""

    def value(v: Any) -> str:
        if isinstance(v, tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if _is_expr(v):
            return expr(v)
        return node(v)

    def inner(q: PNode) -> list[str]:
        return [] if canonical and isinstance(q, PReplicated) else [value(q)]

    def node(q: Any) -> str:
        if isinstance(q, PReplicated):
            return "replicated"
        if isinstance(q, PAverage):
            return f"average({axis(q.axis)})"
        if isinstance(q, PShard):
            if q.axis is not None:
                extra = f", max={expr(q.max)}" if q.max is not None else ""
                return f"shard({expr(q.dim)}, {axis(q.axis)}{extra})"
            return f"shard({expr(q.dim)}, {expr(q.index)}, {expr(q.parts)})"
        if isinstance(q, PBox):
            return f"box({value(q.offsets)}, {value(q.lengths)}, {value(q.shape)})"
        if isinstance(q, PFused):
            if q.sizes is not None:
                sizes = "[" + ", ".join((f"{k}=" if k else "") + expr(v) for k, v in q.sizes) + "]"
            else:
                sizes = expr(q.count)
            return f"fused({expr(q.dim)}, {sizes}, {value(q.inner)})"
        if isinstance(q, PPadded):
            fill = [f"value={expr(q.value)}"] if q.value is not None else []
            return "padded(" + ", ".join([expr(q.dim), expr(q.logical), *inner(q.inner), *fill]) + ")"
        if isinstance(q, PStacked):
            args = [expr(q.dim), *([axis(q.axis)] if q.axis is not None else []), *inner(q.inner)]
            args += [f"{k}={expr(getattr(q, k))}" for k in ("count", "index") if getattr(q, k) is not None]
            if q.by is not None:
                args.append(f"by={q.by.id}")
            return "stacked(" + ", ".join(args) + ")"
        if canonical:
            raise TypeError(f"not a placement node: {q!r}")
        return str(q)

    return value(p)


def format_placement(p: PNode) -> str:
    """Canonical text of a placement node: ``parse_placement(format_placement(p)) == p``."""
    return _print(p, format_expr, lambda a: a.id, canonical=True)


def format_rule(r: RuleText) -> str:
    text = format_placement(r.placement)
    if r.shape is not None:
        text += " : [" + ", ".join(format_expr(e) for e in r.shape) + "]"
    return text


# --------------------------------------------------------------------------------------------
# parser


@dataclass
class _Arg:
    label: str | None
    value: Any  # expression, placement node, or _List
    pos: int


@dataclass
class _List:
    items: list[_Arg]
    pos: int


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = tokenize(text)
        self.i = 0

    # -- helpers

    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def peek(self, k: int = 1) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def error(self, reason: str, pos: int | None = None) -> TextError:
        return TextError(reason, self.tok.pos if pos is None else pos, self.text)

    def found(self) -> str:
        t = self.tok
        return "the end of the text" if t.kind == "end" else repr(t.value)

    def take(self, value: str) -> Token:
        if self.tok.value != value or self.tok.kind == "end":
            raise self.error(f"expected {value!r}, found {self.found()}")
        t = self.tok
        self.i += 1
        return t

    def accept(self, value: str) -> bool:
        if self.tok.kind == "op" and self.tok.value == value:
            self.i += 1
            return True
        return False

    def end(self) -> None:
        if self.tok.kind != "end":
            raise self.error(f"unexpected {self.found()} after the end")

    # -- expressions

    def expr(self) -> Expr:
        left = self.and_()
        while self.tok.kind == "name" and self.tok.value == "or":
            pos = self.tok.pos
            self.i += 1
            left = Binary("or", left, self.and_(), pos)
        return left

    def and_(self) -> Expr:
        left = self.not_()
        while self.tok.kind == "name" and self.tok.value == "and":
            pos = self.tok.pos
            self.i += 1
            left = Binary("and", left, self.not_(), pos)
        return left

    def not_(self) -> Expr:
        if self.tok.kind == "name" and self.tok.value == "not":
            pos = self.tok.pos
            self.i += 1
            return Unary("not", self.not_(), pos)
        left = self.sum()
        if self.tok.kind == "op" and self.tok.value in ("==", "!=", "<", "<=", ">", ">="):
            t = self.tok
            self.i += 1
            left = Binary(t.value, left, self.sum(), t.pos)
        return left

    def sum(self) -> Expr:
        left = self.term()
        while self.tok.kind == "op" and self.tok.value in ("+", "-"):
            t = self.tok
            self.i += 1
            left = Binary(t.value, left, self.term(), t.pos)
        return left

    def term(self) -> Expr:
        left = self.unary()
        while self.tok.kind == "op" and self.tok.value in ("*", "/", "//", "%"):
            t = self.tok
            self.i += 1
            left = Binary(t.value, left, self.unary(), t.pos)
        return left

    def unary(self) -> Expr:
        if self.tok.kind == "op" and self.tok.value == "-":
            pos = self.tok.pos
            self.i += 1
            operand = self.unary()
            if isinstance(operand, Num):
                return Num(-operand.value, pos)
            return Unary("-", operand, pos)
        return self.atom()

    def atom(self) -> Expr:
        t = self.tok
        if t.kind == "num":
            self.i += 1
            v = float(t.value) if any(c in t.value for c in ".eE") else int(t.value)
            return Num(v, t.pos)
        if t.kind == "name":
            if t.value in KEYWORDS:
                raise self.error(f"expected a value, found {t.value!r}")
            self.i += 1
            if self.tok.kind == "op" and self.tok.value == "(":
                if t.value in KINDS:
                    raise self.error(f"placement {t.value!r} cannot appear in an expression", t.pos)
                if t.value not in FUNCS:
                    raise self.error(f"unknown function {t.value!r}; expected one of {', '.join(FUNCS)}", t.pos)
                self.i += 1
                args = [self.expr()]
                while self.accept(","):
                    args.append(self.expr())
                self.take(")")
                want = 2 if t.value == "cdiv" else None
                if (want and len(args) != want) or len(args) < 1:
                    raise self.error(f"{t.value} takes {want or 'at least 1'} arguments, got {len(args)}", t.pos)
                return Func(t.value, tuple(args), t.pos)
            if t.value in KINDS:
                raise self.error(f"placement {t.value!r} cannot appear in an expression", t.pos)
            return Name(t.value, t.pos)
        if self.accept("("):
            e = self.expr()
            self.take(")")
            return e
        raise self.error(f"expected a value, found {self.found()}")

    # -- placements

    def arg(self) -> _Arg:
        label = None
        pos = self.tok.pos
        if self.tok.kind == "name" and self.peek().kind == "op" and self.peek().value == "=":
            label = self.tok.value
            self.i += 2
        return _Arg(label, self.value(), pos)

    def value(self) -> Any:
        t = self.tok
        if t.kind == "name" and t.value in KINDS:
            return self.placement()
        if t.kind == "op" and t.value == "[":
            self.i += 1
            items: list[_Arg] = []
            if not self.accept("]"):
                items.append(self.arg())
                while self.accept(","):
                    items.append(self.arg())
                self.take("]")
            return _List(items, t.pos)
        return self.expr()

    def placement(self) -> PNode:
        t = self.tok
        if t.kind != "name":
            raise self.error(f"expected a placement ({', '.join(KINDS)}), found {self.found()}")
        if t.value not in KINDS:
            hint = _closest(t.value, KINDS)
            raise self.error(
                f"unknown placement {t.value!r}" + (f" (did you mean {hint!r}?)" if hint else "")
                + f"; expected one of {', '.join(KINDS)}"
            )
        self.i += 1
        args: list[_Arg] = []
        if self.accept("("):
            if not self.accept(")"):
                args.append(self.arg())
                while self.accept(","):
                    args.append(self.arg())
                self.take(")")
        elif t.value != "replicated":
            raise self.error(f"{t.value} needs arguments: expected '(', found {self.found()}")
        return _build(t.value, args, t.pos, self)

    def rule(self) -> RuleText:
        p = self.placement()
        shape = None
        if self.accept(":"):
            start = self.tok.pos
            v = self.value()
            if not isinstance(v, _List):
                raise self.error("expected the global shape as a list, e.g. [vocab, hidden]", start)
            shape = tuple(self._expr_item(a, "a global shape dim") for a in v.items)
        self.end()
        return RuleText(p, shape)

    def _expr_item(self, a: _Arg, what: str) -> Expr:
        if a.label is not None:
            raise self.error(f"{what} takes no label", a.pos)
        if isinstance(a.value, (_List,)) or not _is_expr(a.value):
            raise self.error(f"{what} must be an expression", a.pos)
        return a.value


def _is_expr(v: Any) -> bool:
    return isinstance(v, (Num, Name, Unary, Binary, Func))


def _closest(word: str, choices: tuple[str, ...]) -> str | None:
    import difflib

    m = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return m[0] if m else None


# signatures: kind -> ordered parameter names; keyword-only names after "*"
_SIGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "replicated": ((), ()),
    "average": (("axis",), ()),
    "shard": (("dim", "axis", "parts"), ("max",)),
    "box": (("offsets", "lengths", "shape"), ()),
    "fused": (("dim", "sizes", "inner"), ()),
    "padded": (("dim", "logical", "inner"), ("value",)),
    "stacked": (("dim", "axis", "inner"), ("count", "index", "by")),
}
_REQUIRED = {
    "average": ("axis",), "shard": ("dim", "axis"), "box": ("offsets", "lengths", "shape"),
    "fused": ("dim", "sizes"), "padded": ("dim", "logical"), "stacked": ("dim",),
}


def _build(kind: str, args: list[_Arg], pos: int, ps: _Parser) -> PNode:
    positional, keywords = _SIGS[kind]
    got: dict[str, _Arg] = {}
    seen_kw = False
    for i, a in enumerate(args):
        if a.label is None:
            if seen_kw:
                raise ps.error(f"{kind}: a positional argument cannot follow a keyword argument", a.pos)
            # stacked(dim, inner): a placement in the axis slot is the inner placement
            if kind == "stacked" and i == 1 and not _is_expr(a.value):
                got["inner"] = a
                continue
            slot = len([k for k in got if k in positional])
            if slot >= len(positional):
                raise ps.error(f"{kind} takes at most {len(positional)} positional arguments", a.pos)
            got[positional[slot]] = a
        else:
            seen_kw = True
            if a.label not in positional and a.label not in keywords:
                allowed = ", ".join(positional + keywords) or "none"
                raise ps.error(f"{kind} has no argument {a.label!r} (arguments: {allowed})", a.pos)
            if a.label in got:
                raise ps.error(f"{kind}: argument {a.label!r} given twice", a.pos)
            got[a.label] = a
    for k in _REQUIRED.get(kind, ()):
        if k not in got and not (kind == "shard" and k == "axis" and "parts" in got):
            raise ps.error(f"{kind} is missing its argument {k!r}", pos)

    def expr(k: str) -> Expr | None:
        a = got.get(k)
        if a is None:
            return None
        if not _is_expr(a.value):
            raise ps.error(f"{kind}: {k} must be an expression", a.pos)
        return a.value

    def axis(k: str) -> Name | None:
        a = got.get(k)
        if a is None:
            return None
        if not isinstance(a.value, Name):
            raise ps.error(f"{kind}: {k} must be an axis name such as tp, pp, dp or ep", a.pos)
        return a.value

    def exprs(k: str) -> tuple[Expr, ...]:
        a = got[k]
        if not isinstance(a.value, _List):
            raise ps.error(f"{kind}: {k} must be a list, e.g. [0, 128]", a.pos)
        return tuple(ps._expr_item(x, f"{kind} {k} entry") for x in a.value.items)

    def placement(k: str, allowed: tuple[type, ...] | None = None) -> Any:
        a = got.get(k)
        if a is None:
            return PReplicated()
        if isinstance(a.value, _List):
            raise ps.error(f"{kind}: {k} must be one placement", a.pos)
        return _check_inner(kind, a, allowed, ps)

    if kind == "replicated":
        return PReplicated(pos)
    if kind == "average":
        return PAverage(axis("axis"), pos)
    if kind == "shard":
        if "parts" in got:  # shard(dim, index, parts)
            if "max" in got:
                raise ps.error("shard: max= goes with the axis form shard(dim, axis, max=n)", got["max"].pos)
            if "axis" not in got:
                raise ps.error("shard is missing its argument 'index'", pos)
            return PShard(expr("dim"), None, _as_expr(got["axis"], "index", ps), expr("parts"), None, pos)
        return PShard(expr("dim"), axis("axis"), None, None, expr("max"), pos)
    if kind == "box":
        return PBox(exprs("offsets"), exprs("lengths"), exprs("shape"), pos)
    if kind == "fused":
        s = got["sizes"]
        sizes = count = None
        if isinstance(s.value, _List):
            if not s.value.items:
                raise ps.error("fused: sizes must list at least one sub-tensor", s.pos)
            sizes = tuple((x.label, ps._expr_item(_Arg(None, x.value, x.pos), "a fused size")) for x in s.value.items)
        elif _is_expr(s.value):
            count = s.value
        else:
            raise ps.error("fused: sizes must be a list [q=..., k=...] or a count of equal parts", s.pos)
        a = got.get("inner")
        if a is None:
            inner: Any = PReplicated()
        elif isinstance(a.value, _List):
            if a.value.items and any(x.label for x in a.value.items):
                raise ps.error("fused: inner placements take no labels", a.pos)
            inner = tuple(_check_inner(kind, x, _FUSED_INNER, ps) for x in a.value.items)
            n = len(sizes) if sizes is not None else None
            if n is not None and len(inner) != n:
                raise ps.error(f"fused: {len(inner)} inner placements for {n} sub-tensors", a.pos)
        else:
            inner = _check_inner(kind, a, _FUSED_INNER, ps)
        return PFused(expr("dim"), sizes, count, inner, pos)
    if kind == "padded":
        return PPadded(expr("dim"), expr("logical"), placement("inner"), expr("value"), pos)
    # stacked
    if "axis" not in got and "index" not in got:
        raise ps.error("stacked needs an axis (stacked(0, ep)) or index=...", pos)
    if "axis" in got and "index" in got:
        raise ps.error("stacked: give an axis or index=, not both", got["index"].pos)
    if "by" in got and "axis" not in got:
        raise ps.error("stacked: by= goes with the axis form stacked(dim, axis, by=capture)", got["by"].pos)
    by = got.get("by")
    if by is not None and not isinstance(by.value, Name):
        raise ps.error("stacked: by= must name a capture of the pattern, e.g. by=expert", by.pos)
    return PStacked(
        expr("dim"), axis("axis"), placement("inner"), expr("count"), expr("index"),
        by.value if by is not None else None, pos,
    )


_FUSED_INNER = (PReplicated, PShard, PBox)


def _as_expr(a: _Arg, what: str, ps: _Parser) -> Expr:
    if not _is_expr(a.value):
        raise ps.error(f"shard: {what} must be an expression", a.pos)
    return a.value


def _check_inner(kind: str, a: _Arg, allowed: tuple[type, ...] | None, ps: _Parser) -> Any:
    v = a.value
    if _is_expr(v) or isinstance(v, _List):
        raise ps.error(f"{kind}: expected an inner placement, found an expression", a.pos)
    if isinstance(v, PAverage):
        raise ps.error("average(...) is only allowed as a whole rule, not inside another placement", a.pos)
    if allowed is not None and not isinstance(v, allowed):
        raise ps.error(f"{kind}: an inner placement must be replicated, shard or box", a.pos)
    return v


# --------------------------------------------------------------------------------------------
# entry points


def parse_expr(text: str) -> Expr:
    """Parse one expression (``heads * hd``, ``pp_rank == 0 or tie``)."""
    ps = _Parser(text)
    e = ps.expr()
    ps.end()
    return e


def parse_placement(text: str) -> PNode:
    """Parse a placement in text form (no trailing shape)."""
    ps = _Parser(text)
    p = ps.placement()
    ps.end()
    return p


def parse_rule(text: str) -> RuleText:
    """Parse a rule's right-hand side: a placement and an optional ``: [global shape]``."""
    return _Parser(text).rule()


def expr_value_text(e: Expr, env: Mapping[str, Any]) -> str:
    """An expression's value when every name in it is bound (``heads*hd`` -> ``64``), else the
    expression itself."""
    try:
        v = evaluate(e, env)
    except EvalError:
        return format_expr(e)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _axis_text(a: Name, env: Mapping[str, Any]) -> str:
    return f"{a.id}={env[a.id]}" if a.id in env else a.id


def render(p: Any, env: Mapping[str, Any]) -> str:
    """A placement's text with its expressions evaluated and its axes' sizes shown
    (``fused(0, [q=64, k=32, v=32], shard(0, tp=2))``); what cannot be evaluated (rank
    coordinates, captures, unbound symbols) is left as written."""
    return _print(p, lambda e: expr_value_text(e, env), lambda a: _axis_text(a, env), canonical=False)
