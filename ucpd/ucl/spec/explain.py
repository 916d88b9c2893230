"""Which rule of a spec each tensor of a checkpoint followed (``ucpd inspect --spec``).

    from ucpd.format import open_version
    from ucpd.ucl.spec import load_spec, parse_assignments
    from ucpd.ucl.spec.explain import explain

    with open_version(root, step) as v:
        ex = explain(v, load_spec(path_or_name), parse_assignments(["tp=2", "vocab=50257"]))
    print(ex.format())          # or ex.to_json()

A tensor's name is read back through the spec's name templates (``names.param``, then
``optimizer.name`` for optimizer states) to a global parameter name, which is matched against
the rules as on a rank, except that a ``stacked`` rule matches the stacked tensor's name (the
pattern without its captured index). The global shape a rule gives is checked against the
tensor's. Needs no torch. Safe from any thread.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import SpecError
from .layout import BoundSpec
from .patterns import NamePattern
from .spec import Rule, Spec, bind_symbols
from .syntax import EvalError, PStacked, evaluate, format_expr, names_in, render, walk_placement

_MAX_COMBOS = 4096  # rank combinations tried when deciding whether a rule is expected somewhere


@dataclass(frozen=True)
class ExplainRow:
    """One tensor: ``kind`` is "param" or the optimizer state name; ``param`` the global
    parameter; ``rule_pattern``/``rule_text`` as written; ``placement`` the rule with its bound
    symbols shown (``shard(0, tp=2)``); ``problem`` a disagreement (global shape), or None."""

    tensor: str
    kind: str
    param: str
    rule_pattern: str
    rule_text: str
    placement: str
    shape: tuple[int, ...] | None = None
    problem: str | None = None


@dataclass
class Explanation:
    spec: str
    rows: list[ExplainRow] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # tensors no template or rule explains
    unused: list[Rule] = field(default_factory=list)  # rules no tensor followed (where expected)

    @property
    def ok(self) -> bool:
        return not self.unmatched and not self.unused and not any(r.problem for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for ``--json``)."""
        return {
            "spec": self.spec,
            "rows": [
                {"tensor": r.tensor, "kind": r.kind, "param": r.param, "rule": r.rule_pattern,
                 "rule_text": r.rule_text, "placement": r.placement,
                 "shape": None if r.shape is None else list(r.shape), "problem": r.problem}
                for r in self.rows
            ],
            "unmatched": list(self.unmatched),
            "unused": [{"rule": r.pattern.text, "rule_text": r.text} for r in self.unused],
        }

    def table(self) -> list[tuple[str, str, str]]:
        """(tensor, rule pattern, placement [+ problem]) per row, for a table."""
        return [(r.tensor, r.rule_pattern, r.placement + (f"  !! {r.problem}" if r.problem else "")) for r in self.rows]

    def format(self) -> str:
        """Plain text: one line per tensor, then the unmatched tensors and unused rules."""
        rows = [("tensor", "rule", "placement")] + self.table()
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = [f"spec {self.spec}"] + [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
        if self.unmatched:
            lines.append(f"{len(self.unmatched)} tensors follow no rule:")
            lines += [f"  {n}" for n in self.unmatched]
        if self.unused:
            lines.append(f"{len(self.unused)} rules matched no tensor:")
            lines += [f"  {r}" for r in self.unused]
        return "\n".join(lines)


def _template_regex(template: str, groups: Mapping[str, str]) -> re.Pattern:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", template):
        out.append(re.escape(template[pos : m.start()]))
        out.append(f"(?P<{m.group(1)}>{groups[m.group(1)]})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


def _consolidated_patterns(rule: Rule) -> NamePattern:
    """The rule's pattern as the checkpoint names the tensor (a stacked index removed)."""
    pat = rule.pattern
    for node in walk_placement(rule.placement):
        if isinstance(node, PStacked):
            if node.axis is not None:
                by = node.by.id if node.by is not None else ("expert" if "expert" in pat.captures else pat.captures[0])
                return pat.without(by)
            caps = [n.id for n in names_in(node.index) if n.id in pat.captures]
            if caps:
                return pat.without(caps[0])
    return pat


def _expected_somewhere(rule: Rule, env: Mapping[str, Any]) -> bool:
    """Whether ``rule.expect`` holds on at least one rank (True when it cannot be decided)."""
    if rule.expect is None:
        return True
    ranks = sorted({n.id for n in names_in(rule.expect.expr) if n.id.endswith("_rank")})
    sizes = [env.get(r[: -len("_rank")], 1) for r in ranks]
    if not all(isinstance(s, int) and s >= 1 for s in sizes):
        return True
    total = 1
    for s in sizes:
        total *= s
    if total > _MAX_COMBOS:
        return True
    for combo in itertools.product(*(range(s) for s in sizes)):
        try:
            if evaluate(rule.expect.expr, {**env, **dict(zip(ranks, combo))}):
                return True
        except EvalError:
            return True
    return False


def explain(
    version: Any,
    spec: Spec | BoundSpec,
    symbols: Mapping[str, Any] | None = None,
) -> Explanation:
    """Explain every tensor of ``version`` (a ``ucpd.format`` VersionReader, or any mapping /
    object with ``.tensors`` of name -> TensorInfo or shape) by ``spec``.

    ``spec`` is a Spec (``symbols`` bound leniently: whatever is missing stays symbolic and
    unchecked) or a BoundSpec. Raises SpecError only for a symbol given that the spec does not
    know."""
    if isinstance(spec, BoundSpec):
        env = dict(spec.symbols)
        spec = spec.spec
        if symbols:
            env.update(symbols)
    else:
        env = bind_symbols(spec, dict(symbols or {}), partial=True)
    tensors = getattr(version, "tensors", version)
    out = Explanation(spec.name)
    states = spec.optimizer.states if spec.optimizer else ()
    param_rx = _template_regex(spec.param_template, {"param": ".+"})
    optim_rx = (
        _template_regex(spec.optimizer.name, {"param": ".+", "state": "|".join(re.escape(s) for s in states)})
        if spec.optimizer
        else None
    )
    pats = [(_consolidated_patterns(r), r) for r in spec.rules]
    used: set[int] = set()
    for name in sorted(tensors):
        info = tensors[name]
        shape = getattr(info, "shape", info)
        shape = tuple(shape) if shape is not None else None
        kind, param = None, None
        if optim_rx is not None:
            m = optim_rx.fullmatch(name)
            if m:
                kind, param = m.group("state"), m.group("param")
        if param is None:
            m = param_rx.fullmatch(name)
            if m:
                kind, param = "param", m.group("param")
        if param is None:
            out.unmatched.append(name)
            continue
        hit = next(((p, r) for p, r in pats if p.match(param) is not None), None)
        if hit is None:
            out.unmatched.append(name)
            continue
        rule = hit[1]
        used.update(r.index for p, r in pats if r.index not in used and p.match(param) is not None)
        problem = None
        if rule.parsed.shape is not None and shape is not None:
            try:
                want = tuple(evaluate(e, env) for e in rule.parsed.shape)
            except EvalError:
                want = None
            if want is not None and tuple(want) != shape:
                shown = ", ".join(format_expr(e) for e in rule.parsed.shape)
                problem = f"global shape {list(shape)}, the rule says [{shown}] = {list(want)}"
        out.rows.append(ExplainRow(name, kind, param, rule.pattern.text, rule.text, render(rule.placement, env), shape, problem))
    for r in spec.rules:
        if r.index not in used and _expected_somewhere(r, env):
            out.unused.append(r)
    return out


def bind_for_cli(spec_arg: str, sets: list[str] | None) -> tuple[Spec, dict[str, Any]]:
    """``--spec FILE_OR_NAME --set k=v ...`` -> (spec, symbols) for :func:`explain`.
    Raises SpecError (print it and exit 2)."""
    from . import load_spec, parse_assignments

    spec = load_spec(spec_arg)
    symbols = parse_assignments(sets)
    bind_symbols(spec, symbols, partial=True)  # unknown names are reported here
    return spec, symbols


__all__ = ["ExplainRow", "Explanation", "SpecError", "bind_for_cli", "explain"]
