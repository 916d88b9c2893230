"""Spec files: loading (TOML or JSON), validation with file positions, and writing back.

A spec file has these tables (all but ``rules`` optional; ``docs/UCL.md``, "Spec files")::

    [spec]       name, description, version (= 1)
    [symbols]    defaults and derived symbols: name = integer | "expression"
    [coords]     derived rank coordinates: ep_rank = "dp_rank % ep"
    [names]      param = "model.{param}"  (a parameter's flattened name in the state)
    [pipeline]   key = "layers", layers = "num_layers"[, layers_per_stage = [...]]
    [tied]       "output.weight" = "embed.weight"  |  { name = "...", when = "expression" }
    [rules]      "pattern" = "placement[: [global shape]]"  |  { placement = "...", expect = "..." }
    [optimizer]  states, zero, align, param_align, name, flat, [[optimizer.groups]]

Everything that is wrong raises :class:`SpecError` with ``file:line:col``. Safe from any thread
once loaded (a Spec is immutable).
"""

from __future__ import annotations

import copy
import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import SpecError, TextError
from .layout import STANDARD_AXES, BoundSpec
from .patterns import Match, NamePattern, compile_pattern
from .syntax import (
    EvalError,
    Expr,
    Name,
    Num,
    PAverage,
    PStacked,
    RuleText,
    evaluate,
    names_in,
    parse_expr,
    parse_rule,
    walk_placement,
)

SPEC_VERSION = 1
SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
_TOP = ("spec", "symbols", "coords", "names", "pipeline", "tied", "rules", "optimizer")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# --------------------------------------------------------------------------------------------
# where things are in the file


class Source:
    """A spec's text, to turn (key path, value, offset in the value) into ``line:col``."""

    def __init__(self, name: str, text: str | None):
        self.name, self.text = name, text

    def _find_key(self, key: str, start: int) -> re.Match | None:
        forms = {re.escape(json.dumps(key)), re.escape(f"'{key}'")}
        if re.fullmatch(r"[A-Za-z0-9_-]+", key):
            forms.add(rf"(?<![\w\"'.-]){re.escape(key)}(?![\w\"'-])")
        return re.compile(rf"(?:{'|'.join(forms)})\s*[=:\].]").search(self.text or "", start)

    def locate(self, path: tuple, value: str | None = None, offset: int = 0) -> tuple[int, int] | None:
        """Best-effort (line, col) of ``value`` (at ``offset``) under ``path``, or of the key."""
        text = self.text
        if not text:
            return None
        pos, found = 0, None
        for comp in path:
            if not isinstance(comp, str):
                continue
            m = self._find_key(comp, pos)
            if m is None:
                break
            found, pos = m.start(), m.end()
        if found is None:
            return None
        idx = found
        if value is not None:
            raw = text.find(value, pos)
            esc = json.dumps(value)[1:-1]
            eidx = text.find(esc, pos)
            if raw >= 0 and (eidx < 0 or raw <= eidx):
                idx = raw + offset
            elif eidx >= 0:
                idx = eidx + len(json.dumps(value[:offset])[1:-1])
        line = text.count("\n", 0, idx) + 1
        col = idx - (text.rfind("\n", 0, idx) + 1) + 1
        return line, col

    def error(self, reason: str, path: tuple = (), value: str | None = None, offset: int = 0) -> SpecError:
        loc = self.locate(path, value, offset)
        if loc is None:
            where = ".".join(str(p) for p in path)
            return SpecError(f"{where}: {reason}" if where else reason, source=self.name)
        line, col = loc
        snippet = (self.text or "").split("\n")[line - 1]
        return SpecError(reason, source=self.name, line=line, col=col, snippet=snippet)


@dataclass(frozen=True)
class Located:
    """An expression of the spec, with where its text is (for errors found later)."""

    expr: Expr
    text: str
    path: tuple
    src: Source = field(compare=False, repr=False)
    quoted: bool = True  # written as a string (else a bare number in the file)

    def error(self, reason: str, pos: int = 0) -> SpecError:
        return self.src.error(reason, self.path, self.text if self.quoted else None, pos)

    def eval(self, env: Mapping[str, Any]) -> Any:
        try:
            return evaluate(self.expr, env)
        except EvalError as exc:
            raise self.error(exc.reason, exc.pos) from None


def _expr(src: Source, value: Any, path: tuple, what: str) -> Located:
    if isinstance(value, bool):
        return Located(Num(int(value)), str(value).lower(), path, src, False)
    if isinstance(value, (int, float)):
        return Located(Num(value), str(value), path, src, False)
    if not isinstance(value, str):
        raise src.error(f"{what} must be a number or an expression string, got {type(value).__name__}", path)
    try:
        return Located(parse_expr(value), value, path, src)
    except TextError as exc:
        raise src.error(exc.reason, path, value, exc.offset) from None


# --------------------------------------------------------------------------------------------
# the parts of a spec


@dataclass(frozen=True)
class Rule:
    """One ``pattern = placement`` line. ``index`` is its position (first match wins)."""

    index: int
    pattern: NamePattern
    text: str
    parsed: RuleText
    expect: Located | None = None
    note: str | None = None
    src: Source = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    @property
    def placement(self) -> Any:
        return self.parsed.placement

    @property
    def average(self) -> str | None:
        """The axis its replicas are averaged over, for ``average(axis)`` rules."""
        p = self.parsed.placement
        return p.axis.id if isinstance(p, PAverage) else None

    def error(self, reason: str, pos: int = 0) -> SpecError:
        """A SpecError at character ``pos`` of this rule's placement text."""
        return self.src.error(reason, ("rules", self.pattern.text), self.text, pos)

    def eval(self, e: Expr, env: Mapping[str, Any]) -> Any:
        try:
            return evaluate(e, env)
        except EvalError as exc:
            raise self.error(exc.reason, exc.pos) from None

    def __str__(self) -> str:
        return f"{self.pattern.text!r} = {self.text!r}"


@dataclass(frozen=True)
class Tie:
    """``local`` (a stage-local copy of a tied weight) is the global parameter ``name``."""

    local: str
    name: str
    when: Located | None = None


@dataclass(frozen=True)
class Pipeline:
    key: str
    layers: Located
    layers_per_stage: tuple[Located, ...] | None = None


@dataclass(frozen=True)
class Group:
    """A ZeRO parameter group: parameters matching ``match`` partitioned over ``axis``."""

    name: str
    match: tuple[NamePattern, ...]
    axis: str
    flat: str


@dataclass(frozen=True)
class Optimizer:
    states: tuple[str, ...]
    zero: Located
    align: Located
    param_align: Located
    name: str
    flat: str
    groups: tuple[Group, ...] = ()


def _template(src: Source, value: Any, path: tuple, allowed: tuple[str, ...], required: tuple[str, ...]) -> str:
    if not isinstance(value, str) or not value:
        raise src.error("must be a non-empty string template", path)
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
    except ValueError as exc:
        raise src.error(f"bad template: {exc}", path, value) from None
    for f in fields:
        if f not in allowed:
            raise src.error(
                f"unknown placeholder {{{f}}}; allowed: {', '.join('{' + a + '}' for a in allowed)}",
                path, value, value.find("{" + f),
            )
    for r in required:
        if r not in fields:
            raise src.error(f"the template must contain {{{r}}}", path, value)
    return value


def _table(src: Source, d: Any, path: tuple, allowed: tuple[str, ...] | None = None) -> dict:
    if not isinstance(d, Mapping):
        raise src.error(f"must be a table, got {type(d).__name__}", path)
    if allowed is not None:
        for k in d:
            if k not in allowed:
                raise src.error(f"unknown key {k!r}; expected one of {', '.join(allowed)}", path + (k,))
    return dict(d)


# --------------------------------------------------------------------------------------------
# the spec


class Spec:
    """A parsed, validated spec. Build with :func:`load_spec`, :func:`loads_spec` or
    :func:`spec_from_dict`; ``bind(**symbols)`` fixes the run's configuration."""

    def __init__(self, raw: Mapping[str, Any], src: Source):
        self.src = src
        self._raw = copy.deepcopy(dict(raw))
        d = _table(src, raw, ())
        for k in d:
            if k not in _TOP:
                raise src.error(f"unknown table [{k}]; expected one of {', '.join(_TOP)}", (k,))
        meta = _table(src, d.get("spec", {}), ("spec",), ("name", "description", "version"))
        self.name: str = str(meta.get("name") or Path(src.name).stem)
        self.description: str = str(meta.get("description", ""))
        version = meta.get("version", SPEC_VERSION)
        if version != SPEC_VERSION:
            raise src.error(f"spec version {version!r} is not supported (this ucpd reads {SPEC_VERSION})", ("spec", "version"))

        self.symbols: dict[str, Located] = {}
        for k, v in _table(src, d.get("symbols", {}), ("symbols",)).items():
            if not _IDENT.match(k) or k.endswith("_rank"):
                raise src.error(f"symbol {k!r} must be a name (not ending in _rank)", ("symbols", k))
            self.symbols[k] = _expr(src, v, ("symbols", k), f"symbol {k!r}")
        self.coords: dict[str, Located] = {}
        for k, v in _table(src, d.get("coords", {}), ("coords",)).items():
            if not _IDENT.match(k) or not k.endswith("_rank"):
                raise src.error(f"coordinate {k!r} must be a name ending in _rank (e.g. ep_rank)", ("coords", k))
            self.coords[k] = _expr(src, v, ("coords", k), f"coordinate {k!r}")

        names = _table(src, d.get("names", {}), ("names",), ("param",))
        self.param_template = _template(src, names.get("param", "model.{param}"), ("names", "param"), ("param",), ("param",))

        self.pipeline: Pipeline | None = None
        if "pipeline" in d:
            p = _table(src, d["pipeline"], ("pipeline",), ("key", "layers", "layers_per_stage"))
            key = p.get("key", "layers")
            if not isinstance(key, str) or not key:
                raise src.error("pipeline.key must name the component before the layer index, e.g. \"layers\"", ("pipeline", "key"))
            if "layers" not in p:
                raise src.error("pipeline needs layers = <total number of layers> (an expression)", ("pipeline",))
            per = p.get("layers_per_stage")
            if per is not None:
                if not isinstance(per, list):
                    raise src.error("pipeline.layers_per_stage must be a list", ("pipeline", "layers_per_stage"))
                per = tuple(_expr(src, v, ("pipeline", "layers_per_stage"), "a stage's layer count") for v in per)
            self.pipeline = Pipeline(key, _expr(src, p["layers"], ("pipeline", "layers"), "pipeline.layers"), per)

        self.ties: list[Tie] = []
        for k, v in _table(src, d.get("tied", {}), ("tied",)).items():
            when = None
            if isinstance(v, Mapping):
                t = _table(src, v, ("tied", k), ("name", "when"))
                if "name" not in t:
                    raise src.error("a tie needs name = <the global parameter>", ("tied", k))
                v = t["name"]
                if "when" in t:
                    when = _expr(src, t["when"], ("tied", k, "when"), "tied.when")
            if not isinstance(v, str) or not v:
                raise src.error("a tie maps a local name to a global parameter name (a string)", ("tied", k))
            self.ties.append(Tie(k, v, when))

        rules = d.get("rules")
        if rules is None:
            raise src.error("a spec needs a [rules] table")
        self.rules: list[Rule] = []
        for i, (k, v) in enumerate(_table(src, rules, ("rules",)).items()):
            self.rules.append(self._rule(i, k, v))
        if not self.rules:
            raise src.error("[rules] is empty", ("rules",))

        self.optimizer: Optimizer | None = None
        if "optimizer" in d:
            self.optimizer = self._optimizer(d["optimizer"])
        self._check_names()

    # -- parsing helpers

    def _rule(self, i: int, key: str, v: Any) -> Rule:
        src = self.src
        path = ("rules", key)
        try:
            pat = compile_pattern(key)
        except TextError as exc:
            raise src.error(exc.reason, ("rules",), key, exc.offset) from None
        expect = note = None
        if isinstance(v, Mapping):
            t = _table(src, v, path, ("placement", "expect", "note"))
            if "placement" not in t:
                raise src.error("a rule table needs placement = \"...\"", path)
            if "expect" in t:
                expect = _expr(src, t["expect"], path + ("expect",), "expect")
            note = t.get("note")
            v = t["placement"]
        if not isinstance(v, str):
            raise src.error(f"a rule's placement must be a string such as \"shard(0, tp)\", got {type(v).__name__}", path)
        try:
            parsed = parse_rule(v)
        except TextError as exc:
            raise src.error(exc.reason, path, v, exc.offset) from None
        rule = Rule(i, pat, v, parsed, expect, note, src)
        for node in walk_placement(parsed.placement):
            if isinstance(node, PStacked) and node.axis is not None:
                by = node.by.id if node.by is not None else ("expert" if "expert" in pat.captures else None)
                if by is None and len(pat.captures) == 1:
                    by = pat.captures[0]
                if by is None or by not in pat.captures:
                    raise rule.error(
                        f"stacked({node.axis.id}) needs the local item index captured in the pattern, "
                        f"e.g. \"...experts.{{expert}}.fc1.weight\"" + (f" (by={by} is not a capture)" if by else ""),
                        node.pos,
                    )
        return rule

    def _optimizer(self, raw: Any) -> Optimizer:
        src = self.src
        path = ("optimizer",)
        o = _table(src, raw, path, ("states", "zero", "align", "param_align", "name", "flat", "groups"))
        states = o.get("states", ["exp_avg", "exp_avg_sq"])
        if not isinstance(states, list) or not states or not all(isinstance(s, str) and s for s in states):
            raise src.error("optimizer.states must list state names, e.g. [\"exp_avg\", \"exp_avg_sq\"]", path + ("states",))
        name = _template(src, o.get("name", "optim.{param}.{state}"), path + ("name",), ("param", "state"), ("param", "state"))
        flat = _template(src, o.get("flat", "optim.{state}"), path + ("flat",), ("state", "group"), ("state",))
        groups = []
        raw_groups = o.get("groups", [])
        if not isinstance(raw_groups, list):
            raise src.error("optimizer.groups must be a list of tables ([[optimizer.groups]])", path + ("groups",))
        for j, g in enumerate(raw_groups):
            gp = path + ("groups", j)
            g = _table(src, g, gp, ("name", "match", "axis", "flat"))
            gname = g.get("name")
            if not isinstance(gname, str) or not _IDENT.match(gname):
                raise src.error("a ZeRO group needs name = <identifier>", gp + ("name",))
            match = g.get("match")
            if isinstance(match, str):
                match = [match]
            if not isinstance(match, list) or not match:
                raise src.error("a ZeRO group needs match = [parameter patterns]", gp + ("match",))
            pats = []
            for m in match:
                try:
                    pats.append(compile_pattern(m))
                except TextError as exc:
                    raise src.error(exc.reason, gp + ("match",), m, exc.offset) from None
            axis = g.get("axis", "dp")
            if not isinstance(axis, str) or not _IDENT.match(axis):
                raise src.error("a ZeRO group's axis must be a symbol such as dp", gp + ("axis",))
            gflat = _template(src, g.get("flat", "optim.{group}.{state}"), gp + ("flat",), ("state", "group"), ("state",))
            groups.append(Group(gname, tuple(pats), axis, gflat))
        return Optimizer(
            tuple(states),
            _expr(src, o.get("zero", 0), path + ("zero",), "optimizer.zero"),
            _expr(src, o.get("align", 1), path + ("align",), "optimizer.align"),
            _expr(src, o.get("param_align", 1), path + ("param_align",), "optimizer.param_align"),
            name,
            flat,
            tuple(groups),
        )

    def _check_names(self) -> None:
        """Captures and rank coordinates used where they can have a value."""
        for r in self.rules:
            caps = set(r.pattern.captures)
            for n in names_in(r.parsed):
                if n.id in caps and r.parsed.shape is not None and _in_shape(r.parsed, n):
                    raise r.error(f"capture {n.id!r} cannot size the global shape", n.pos)
            if r.expect is not None:
                for n in names_in(r.expect.expr):
                    if n.id in caps:
                        raise r.expect.error(f"expect cannot use the capture {n.id!r}", n.pos)
        for loc in self.symbols.values():
            for n in names_in(loc.expr):
                if n.id.endswith("_rank"):
                    raise loc.error(f"a symbol cannot depend on the rank coordinate {n.id!r}; use [coords]", n.pos)

    # -- queries

    def match(self, name: str) -> tuple[Rule, Match] | None:
        """The first rule whose pattern matches ``name`` (a global parameter name whose
        expert indices, if any, are still local), with its captures."""
        for r in self.rules:
            m = r.pattern.match(name)
            if m is not None:
                return r, m
        return None

    def located(self) -> list[tuple[Located | Rule, Expr]]:
        """Every expression of the spec with its owner (for checks at bind time)."""
        out: list[tuple[Any, Expr]] = []
        for loc in list(self.coords.values()):
            out.append((loc, loc.expr))
        if self.pipeline:
            for loc in (self.pipeline.layers, *(self.pipeline.layers_per_stage or ())):
                out.append((loc, loc.expr))
        for t in self.ties:
            if t.when is not None:
                out.append((t.when, t.when.expr))
        for r in self.rules:
            out.append((r, r.parsed))  # type: ignore[arg-type]
            if r.expect is not None:
                out.append((r.expect, r.expect.expr))
        if self.optimizer:
            for loc in (self.optimizer.zero, self.optimizer.align, self.optimizer.param_align):
                out.append((loc, loc.expr))
        return out

    def axes(self) -> set[str]:
        """Symbols used as parallel axes (``shard(0, tp)``, ZeRO group axes, ``..._rank``)."""
        out = set()
        for r in self.rules:
            for node in walk_placement(r.parsed.placement):
                ax = getattr(node, "axis", None)
                if isinstance(ax, Name):
                    out.add(ax.id)
        for _, e in self.located():
            for n in names_in(e):
                if n.id.endswith("_rank"):
                    out.add(n.id[: -len("_rank")])
        if self.pipeline:
            out.add("pp")
        if self.optimizer:
            out.add("dp")
            out.update(g.axis for g in self.optimizer.groups)
        return out

    def bind(self, **symbols: Any) -> BoundSpec:
        """Fix the run's configuration: parallel sizes (``tp``, ``pp``, ``dp``, ``ep``; 1 when
        not given) and model symbols (``vocab``, ``heads``, ...). Defaults come from
        ``[symbols]``. Raises SpecError for a symbol the spec needs and nobody gave (at its
        position in the file) or a name the spec does not know."""
        return BoundSpec(self, bind_symbols(self, symbols))

    # -- writing

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain dict (what the file holds); ``spec_from_dict`` reads it back."""
        return copy.deepcopy(self._raw)

    def to_json(self, indent: int | None = 2) -> str:
        """The JSON equivalent of the spec file."""
        return json.dumps(self._raw, indent=indent) + "\n"

    def to_toml(self) -> str:
        """The spec as a TOML file (tables in the canonical order)."""
        return dumps_toml(self._raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self._raw == other._raw

    def __repr__(self) -> str:
        return f"Spec({self.name!r}, {len(self.rules)} rules, from {self.src.name})"


def _in_shape(parsed: RuleText, n: Name) -> bool:
    return any(n is x for e in (parsed.shape or ()) for x in names_in(e))




def known_symbols(spec: Spec) -> set[str]:
    """Every symbol name a spec uses or defines (rank coordinates excluded)."""
    known = set(spec.symbols) | set(STANDARD_AXES) | spec.axes()
    for _, e in spec.located():
        known.update(n.id for n in names_in(e))
    for loc in spec.symbols.values():
        known.update(n.id for n in names_in(loc.expr))
    for r in spec.rules:
        known -= set(r.pattern.captures)
        if any(isinstance(n, PStacked) and n.axis is not None and n.count is None for n in walk_placement(r.placement)):
            known.add("experts")  # stacked(dim, axis) counts its items with the symbol experts
    return {k for k in known if not k.endswith("_rank")}


def bind_symbols(spec: Spec, given: Mapping[str, Any], partial: bool = False) -> dict[str, int | float]:
    env: dict[str, int | float] = {}
    known = known_symbols(spec)
    for k, v in given.items():
        if k.endswith("_rank"):
            raise SpecError(f"{k} is a rank coordinate: pass it in RankCoords, not to bind()", source=spec.src.name)
        if k not in known:
            raise SpecError(
                f"spec {spec.name!r} does not use the symbol {k!r}; its symbols: {', '.join(sorted(known))}",
                source=spec.src.name,
            )
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)):
            raise SpecError(f"symbol {k!r} must be a number, got {v!r}", source=spec.src.name)
        env[k] = v
    resolving: list[str] = []

    def value(name: str) -> int | float:
        if name in env:
            return env[name]
        loc = spec.symbols[name]
        if name in resolving:
            cycle = " -> ".join(resolving[resolving.index(name):] + [name])
            raise loc.error(f"symbols depend on each other in a cycle: {cycle}")
        resolving.append(name)
        for n in names_in(loc.expr):
            if n.id not in env and n.id in spec.symbols:
                value(n.id)
        resolving.pop()
        env[name] = loc.eval(env)
        return env[name]

    for ax in STANDARD_AXES:
        if ax not in spec.symbols:
            env.setdefault(ax, 1)
    for name in spec.symbols:
        if partial:
            try:
                value(name)
            except SpecError:
                resolving.clear()
        else:
            value(name)
    if partial:
        return env
    # every name the spec uses must now have a value, except rank coordinates and captures
    for owner, e in spec.located():
        caps = set(owner.pattern.captures) if isinstance(owner, Rule) else set()
        for n in names_in(e):
            if n.id in env or n.id.endswith("_rank") or n.id in caps:
                continue
            raise owner.error(f"symbol {n.id!r} is not bound: pass {n.id}=... to bind() or give it a default in [symbols]", n.pos)
    for ax in spec.axes():
        if ax not in env:
            raise SpecError(f"axis {ax!r} has no size: pass {ax}=... to bind()", source=spec.src.name)
        if not isinstance(env[ax], int) or env[ax] < 1:
            raise SpecError(f"axis {ax!r} must be a positive integer, got {env[ax]!r}", source=spec.src.name)
    return env


# --------------------------------------------------------------------------------------------
# loading


def list_specs() -> list[str]:
    """Names of the specs shipped with ucpd (``load_spec(name)`` loads one)."""
    return sorted(p.stem for p in SPECS_DIR.glob("*.toml")) + sorted(
        p.stem for p in SPECS_DIR.glob("*.json") if not (SPECS_DIR / (p.stem + ".toml")).exists()
    )


def load_spec(path_or_name: str | Path) -> Spec:
    """Load a spec file (``.toml`` or ``.json``) or a shipped family by name
    (``load_spec("megatron-gpt")``; see :func:`list_specs`)."""
    p = Path(path_or_name)
    if not p.exists() and isinstance(path_or_name, str) and "/" not in path_or_name and p.suffix not in (".toml", ".json"):
        for ext in (".toml", ".json"):
            cand = SPECS_DIR / f"{path_or_name}{ext}"
            if cand.exists():
                p = cand
                break
        else:
            raise SpecError(
                f"no spec file {path_or_name!r} and no shipped spec of that name; shipped: {', '.join(list_specs())}"
            )
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"cannot read the spec file: {exc.strerror}", source=str(p)) from None
    fmt = "json" if p.suffix == ".json" else "toml"
    return loads_spec(text, format=fmt, source=str(p))


def loads_spec(text: str, *, format: str = "toml", source: str = "<string>") -> Spec:
    """Parse a spec from text (``format`` "toml" or "json")."""
    if format == "json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            line = text.split("\n")[exc.lineno - 1] if exc.lineno - 1 < len(text.split("\n")) else ""
            raise SpecError(exc.msg, source=source, line=exc.lineno, col=exc.colno, snippet=line) from None
    elif format == "toml":
        import tomllib

        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            msg = str(exc)
            m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
            if m is None:
                m2 = re.search(r"\(at end of document\)", msg)
                lines = text.split("\n")
                line, col = (len(lines), len(lines[-1]) + 1) if m2 else (None, None)
            else:
                line, col = int(m.group(1)), int(m.group(2))
            reason = re.sub(r"\s*\(at (line \d+, column \d+|end of document)\)", "", msg)
            snippet = text.split("\n")[line - 1] if line else None
            raise SpecError(f"TOML: {reason}", source=source, line=line, col=col, snippet=snippet) from None
    else:
        raise SpecError(f"unknown spec format {format!r}; use toml or json", source=source)
    return Spec(raw, Source(source, text))


def spec_from_dict(d: Mapping[str, Any], *, source: str = "<dict>") -> Spec:
    """A spec from its dict form (``Spec.to_dict()``, a parsed JSON or TOML file). Errors
    name the key path (there is no text to point into)."""
    return Spec(d, Source(source, json.dumps(d, indent=1)))


# --------------------------------------------------------------------------------------------
# writing TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dumps_toml(d: Mapping[str, Any]) -> str:
    """Write a spec dict as TOML (tables of scalars, lists and inline tables; the optimizer's
    groups as ``[[optimizer.groups]]``)."""
    out: list[str] = []
    for table in sorted(d, key=lambda k: _TOP.index(k) if k in _TOP else len(_TOP)):
        body = d[table]
        out.append(f"[{table}]")
        groups = None
        for k, v in body.items():
            if table == "optimizer" and k == "groups":
                groups = v
                continue
            out.append(f"{json.dumps(k)} = {_toml_value(v)}")
        out.append("")
        for g in groups or ():
            out.append("[[optimizer.groups]]")
            out.extend(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in g.items())
            out.append("")
    return "\n".join(out)
