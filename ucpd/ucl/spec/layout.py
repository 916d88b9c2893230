"""Resolution: a bound spec, one rank's coordinates and its local parameters -> that rank's
placements for ``snapshot()`` / ``restore()``.

    bound = load_spec("megatron-gpt").bind(tp=2, pp=2, dp=2, vocab=50257, hidden=1024, ...)
    lay = bound.placements(RankCoords(tp_rank=1, pp_rank=0, dp_rank=1), params={name: shape})
    state = {"model": lay.rename(model_tensors), "optim": {...}}
    ckpt.snapshot(step, state, placements=lay.placements)

For each local parameter: the pipeline rule renumbers its layer index to the global one, a tie
maps a stage's copy of a tied weight to the one global parameter, the first rule whose pattern
matches the name gives the placement (expert indices are made global by ``stacked``), and the
placement is checked against the local shape (and the rule's global shape, if it gives one).
Optimizer states follow their parameter (ZeRO 0), or are the rank's ``Flat`` partitions of
each group's buffer (ZeRO 1/2, ``ucpd.ucl.layouts.zero_partitions``), or per-parameter flat
partitions (ZeRO 3, ``layouts.zero3_param``).

Pipeline and ZeRO helpers come from ``ucpd.ucl.layouts``.
Pure functions of their arguments; safe from any thread.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ...errors import InvalidPlacement, PlacementMismatch
from .. import layouts as L
from ..placements import Box, Fused, Padded, Placement, Replicated, Shard, Stacked
from ..resolve import resolve
from .errors import SpecError, SpecMismatch
from .patterns import Match, drop_component, replace_component
from .syntax import (
    Expr,
    Name,
    PAverage,
    PBox,
    PFused,
    PPadded,
    PReplicated,
    PShard,
    PStacked,
    names_in,
)

if TYPE_CHECKING:  # annotations only: a spec binds into a BoundSpec (``Spec.bind``), not the other way
    from .spec import Rule, Spec

STANDARD_AXES = ("tp", "pp", "dp", "ep", "cp")  # default to 1 when a spec does not bind them


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinate on each parallel axis. None: not given (derived by the spec's
    ``[coords]``, else 0 when the axis has size 1). ``extra`` holds other axes
    (``{"cp_rank": 1}``)."""

    tp_rank: int | None = None
    pp_rank: int | None = None
    dp_rank: int | None = None
    ep_rank: int | None = None
    extra: Mapping[str, int] = field(default_factory=dict)

    def given(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in ("tp_rank", "pp_rank", "dp_rank", "ep_rank") if getattr(self, k) is not None}
        for k, v in self.extra.items():
            out[k if k.endswith("_rank") else f"{k}_rank"] = v
        return out

    @classmethod
    def of_rank(cls, rank: int, *, tp: int = 1, pp: int = 1, dp: int = 1, order: Sequence[str] = ("tp", "dp", "pp")) -> "RankCoords":
        """Coordinates of global ``rank`` when the axes are laid out fastest first in ``order``
        (Megatron: tensor-parallel ranks adjacent, then data-parallel, then pipeline)."""
        sizes = {"tp": tp, "pp": pp, "dp": dp}
        if not 0 <= rank < tp * pp * dp:
            raise InvalidPlacement(f"rank {rank} is outside a world of {tp * pp * dp} (tp {tp}, pp {pp}, dp {dp})")
        out = {}
        for ax in order:
            out[f"{ax}_rank"] = rank % sizes[ax]
            rank //= sizes[ax]
        return cls(**out)


@dataclass
class ResolvedLayout:
    """What a spec says about one rank's state.

    placements:  flattened state names -> UCL placements (parameters under the spec's
                 ``names.param`` template, optimizer states under ``optimizer.name`` / ``.flat``),
                 for ``Checkpointer.snapshot(..., placements=...)`` and ``restore``.
    shapes:      the same names -> the local shapes the placements expect.
    params:      global parameter names -> placements (no template).
    global_names: local parameter names -> global parameter names.
    rules:       global parameter names -> the Rule that placed them.
    tied:        local names dropped as duplicates of a tied weight this rank holds twice
                 (separate tensors: copy the kept one into them after a restore).
    averaged:    global tensor names (as consolidated) -> the axis their replicas are averaged over.
    optimizer:   the optimizer-state entries of ``placements``.
    unused:      rules expected on this rank that matched nothing (an error when strict).
    warnings:    what a lenient resolution let pass.
    """

    coords: dict[str, int]
    placements: dict[str, Placement] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    params: dict[str, Placement] = field(default_factory=dict)
    global_names: dict[str, str] = field(default_factory=dict)
    rules: dict[str, Rule] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    averaged: dict[str, str] = field(default_factory=dict)
    optimizer: dict[str, Placement] = field(default_factory=dict)
    unused: list[Rule] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def rename(self, local: Mapping[str, Any]) -> dict[str, Any]:
        """``{local name: value}`` -> ``{global name: value}`` (the same objects), dropping
        the duplicates of tied weights. Nest it under the state key of ``names.param``
        (``{"model": lay.rename(params)}`` for ``model.{param}``)."""
        out = {}
        for k, v in local.items():
            if k in self.tied:
                continue
            if k not in self.global_names:
                raise SpecMismatch("cannot rename", [f"{k!r} is not one of the parameters this layout was resolved for"])
            out[self.global_names[k]] = v
        return out

    def describe(self) -> list[tuple[str, str, str, str]]:
        """(local name, global name, rule pattern, placement) per parameter."""
        rows = []
        for local, g in self.global_names.items():
            r = self.rules.get(g)
            rows.append((local, g, r.pattern.text if r else "", str(self.params.get(g, ""))))
        return rows


@dataclass
class _Ctx:
    rule: Rule
    env: dict[str, Any]
    match: Match
    name: str  # the name the rule matched
    key: str | None = None  # per-item global name (expert index made global)
    stacked_name: str | None = None


def _num(ctx: _Ctx, e: Expr, what: str, *, minimum: int | None = 0) -> int:
    v = ctx.rule.eval(e, ctx.env)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int):
        raise ctx.rule.error(f"{what} must be a whole number, got {v!r}", e.pos)
    if minimum is not None and v < minimum:
        raise ctx.rule.error(f"{what} must be >= {minimum}, got {v}", e.pos)
    return v


def _axis(ctx: _Ctx, axis: Name) -> tuple[int, int]:
    size, rank = ctx.env.get(axis.id), ctx.env.get(f"{axis.id}_rank")
    if size is None:
        raise ctx.rule.error(f"axis {axis.id!r} has no size: pass {axis.id}=... to bind()", axis.pos)
    if rank is None:
        raise ctx.rule.error(f"this rank has no {axis.id}_rank: pass it in RankCoords", axis.pos)
    return size, rank


def _make(p: Any, ctx: _Ctx, lshape: tuple[int, ...]) -> Placement:
    rule = ctx.rule
    try:
        return _make_unchecked(p, ctx, lshape)
    except SpecError:
        raise
    except InvalidPlacement as exc:  # a constructor refused the values
        raise rule.error(str(exc), p.pos) from None


def _make_unchecked(p: Any, ctx: _Ctx, lshape: tuple[int, ...]) -> Placement:
    rule = ctx.rule
    if isinstance(p, (PReplicated, PAverage)):
        if isinstance(p, PAverage):
            _axis(ctx, p.axis)
        return Replicated()
    if isinstance(p, PShard):
        dim = _num(ctx, p.dim, "shard dim")
        if p.axis is None:
            return Shard(dim, _num(ctx, p.index, "shard index"), _num(ctx, p.parts, "shard parts", minimum=1))
        size, rank = _axis(ctx, p.axis)
        parts, index = size, rank
        if p.max is not None:
            m = _num(ctx, p.max, "shard max", minimum=1)
            if m >= size:
                if m % size:
                    raise rule.error(f"max={m} and {p.axis.id}={size}: one must divide the other", p.max.pos)
            else:
                if size % m:
                    raise rule.error(f"max={m} and {p.axis.id}={size}: one must divide the other", p.max.pos)
                parts, index = m, rank // (size // m)
        return Replicated() if parts == 1 else Shard(dim, index, parts)
    if isinstance(p, PBox):
        vals = [tuple(_num(ctx, e, "a box entry") for e in xs) for xs in (p.offsets, p.lengths, p.shape)]
        return Box(*vals)
    if isinstance(p, PFused):
        dim = _num(ctx, p.dim, "fused dim")
        if p.sizes is not None:
            sizes = [_num(ctx, e, f"fused size {k or i}", minimum=1) for i, (k, e) in enumerate(p.sizes)]
            inner = (
                tuple(_make(q, ctx, lshape) for q in p.inner) if isinstance(p.inner, tuple) else _make(p.inner, ctx, lshape)
            )
            return Fused(dim, tuple(sizes), inner)
        n = _num(ctx, p.count, "fused count", minimum=1)
        inners = p.inner if isinstance(p.inner, tuple) else (p.inner,) * n
        if len(inners) != n:
            raise rule.error(f"fused: {len(inners)} inner placements for {n} sub-tensors", p.pos)
        if dim >= len(lshape) or lshape[dim] % n:
            raise PlacementMismatch(
                f"fused({dim}, {n}, ...) needs a local dim {dim} divisible by {n}, got shape {lshape}"
            )
        ext = lshape[dim] // n
        built = tuple(_make(q, ctx, lshape) for q in inners)
        sizes = []
        for q in built:
            if isinstance(q, Box):
                raise rule.error("fused with a count of equal parts cannot hold box sub-tensors", p.pos)
            sizes.append(ext * q.parts if isinstance(q, Shard) and q.dim == dim else ext)
        return Fused(dim, tuple(sizes), built if isinstance(p.inner, tuple) else built[0])
    if isinstance(p, PPadded):
        value = 0 if p.value is None else ctx.rule.eval(p.value, ctx.env)
        return Padded(_num(ctx, p.dim, "padded dim"), _num(ctx, p.logical, "padded logical"), _make(p.inner, ctx, lshape), value)
    if isinstance(p, PStacked):
        dim = _num(ctx, p.dim, "stacked dim")
        inner = _make(p.inner, ctx, lshape)
        count = None if p.count is None else _num(ctx, p.count, "stacked count", minimum=1)
        if p.axis is not None:
            size, rank = _axis(ctx, p.axis)
            if count is None:
                if "experts" not in ctx.env:
                    raise rule.error("stacked needs count=... or the symbol experts bound", p.pos)
                count = ctx.env["experts"]
            if count % size:
                raise rule.error(f"{count} items do not split evenly over {p.axis.id}={size}", p.pos)
            by = p.by.id if p.by is not None else ("expert" if "expert" in ctx.match.captures else next(iter(ctx.match.captures)))
            local, span = ctx.match.captures[by]
            n_local = count // size
            if local >= n_local:
                raise PlacementMismatch(
                    f"local index {by}={local} but a rank holds {n_local} of {count} items ({p.axis.id}={size})"
                )
            index = rank * n_local + local
        else:
            index = _num(ctx, p.index, "stacked index")
            caps = [n.id for n in names_in(p.index) if n.id in ctx.match.captures]
            span = ctx.match.captures[caps[0]][1] if caps else None
        if span is not None:
            ctx.key = replace_component(ctx.name, span, index)
            ctx.stacked_name = drop_component(ctx.name, span)
        return Stacked(dim, index, inner, count, ctx.stacked_name)
    raise rule.error(f"cannot build a placement from {p!r}")


def rename_stacked(p: Placement, fn: Callable[[str], str]) -> Placement:
    """``p`` with every ``Stacked.name`` passed through ``fn`` (the global name of a stacked
    tensor follows the state name template of the tensor that holds it)."""
    if isinstance(p, Stacked):
        return replace(p, inner=rename_stacked(p.inner, fn), name=fn(p.name) if p.name else p.name)
    if isinstance(p, Padded):
        return replace(p, inner=rename_stacked(p.inner, fn))
    return p


def _shape(v: Any) -> tuple[int, ...]:
    s = getattr(v, "shape", v)
    return tuple(int(n) for n in s)


class BoundSpec:
    """A spec with the run's configuration fixed (``Spec.bind``). ``symbols`` holds every
    symbol's value."""

    def __init__(self, spec: Spec, symbols: dict[str, Any]):
        self.spec = spec
        self.symbols = dict(symbols)

    def __repr__(self) -> str:
        return f"BoundSpec({self.spec.name!r}, {self.symbols})"

    # -- rank environment

    def env(self, coords: RankCoords | Mapping[str, int] | None = None) -> dict[str, Any]:
        """Symbols plus this rank's coordinates (given, derived by ``[coords]``, or 0 on an
        axis of size 1). Raises SpecError for a missing or out-of-range coordinate."""
        env = dict(self.symbols)
        given = coords.given() if isinstance(coords, RankCoords) else dict(coords or {})
        env.update(given)
        for k, loc in self.spec.coords.items():
            if k not in given:
                env[k] = loc.eval(env)
        src = self.spec.src.name
        for ax in sorted(self.spec.axes() | set(STANDARD_AXES)):
            rk = f"{ax}_rank"
            size = env.get(ax, 1)
            if rk not in env:
                if size != 1:
                    raise SpecError(f"this rank's {rk} is needed ({ax} = {size}): pass RankCoords({rk}=...)", source=src)
                env[rk] = 0
            v = env[rk]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size:
                raise SpecError(f"{rk} = {v!r} is outside [0, {size}) ({ax} = {size})", source=src)
        return env

    def layer_offset(self, env: Mapping[str, Any]) -> int:
        """Global index of this pipeline stage's first layer (0 without a [pipeline] table)."""
        pl = self.spec.pipeline
        if pl is None or env.get("pp", 1) == 1:
            return 0

        layers = pl.layers.eval(env)
        per = [loc.eval(env) for loc in pl.layers_per_stage] if pl.layers_per_stage else None
        try:
            return L.pipeline_layer_offset(env["pp_rank"], env["pp"], layers, layers_per_stage=per)
        except InvalidPlacement as exc:
            raise pl.layers.error(str(exc)) from None

    def global_name(self, local: str, env: Mapping[str, Any], offset: int | None = None) -> str:
        """A local parameter name with its layer renumbered and ties applied (expert indices
        stay local: ``stacked`` makes them global)."""
        pl = self.spec.pipeline
        off = self.layer_offset(env) if offset is None else offset
        name = local
        if pl is not None and off:

            name = L.global_layer_name(local, off, key=pl.key)
        for t in self.spec.ties:
            if t.local in (name, local) and (t.when is None or t.when.eval(env)):
                return t.name
        return name

    # -- resolution

    def placements(
        self,
        coords: RankCoords | Mapping[str, int] | None = None,
        params: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
    ) -> ResolvedLayout:
        """Resolve one rank's local parameters (``{local name: shape or tensor}``, in the
        optimizer's order) to placements.

        Raises SpecMismatch naming every parameter no rule matches, every placement that
        disagrees with a local shape or a rule's global shape, and (strict) every rule that
        matched nothing on a rank where it is expected; with ``strict=False`` unused rules
        are warnings (``warnings.warn`` and ``.warnings``). SpecError for a bad coordinate.
        """
        spec = self.spec
        env = self.env(coords)
        out = ResolvedLayout({k: v for k, v in env.items() if k.endswith("_rank")})
        offset = self.layer_offset(env)
        unmatched, shape_problems, other = [], [], []
        used: set[int] = set()
        order: list[str] = []
        for local, value in (params or {}).items():
            lshape = _shape(value)
            name = self.global_name(local, env, offset)
            hit = spec.match(name)
            if hit is None:
                unmatched.append(local if name == local else f"{local} (global name {name})")
                continue
            rule, m = hit
            used.add(rule.index)
            for r in spec.rules:  # "matched nothing" means no name matched, even if an earlier rule won
                if r.index not in used and r.pattern.match(name) is not None:
                    used.add(r.index)
            ctx = _Ctx(rule, {**env, **m.values()}, m, name)
            try:
                p = _make(rule.placement, ctx, lshape)
                key = ctx.key or name
                frags = resolve(key, p, lshape)
                gshape = frags[0].global_shape if frags else None
                if rule.parsed.shape is not None and gshape is not None:
                    want = tuple(_num(ctx, e, "a global shape dim") for e in rule.parsed.shape)
                    if len(want) != len(gshape) or any(g is not None and g != w for g, w in zip(gshape, want)):
                        raise PlacementMismatch(
                            f"the rule says the global shape is {list(want)}, but the local shape "
                            f"{list(lshape)} under {p} gives {list(gshape)}"
                        )
            except SpecError:
                raise
            except PlacementMismatch as exc:
                shape_problems.append(f"{local}: {exc} [rule {rule}]")
                continue
            if key in out.params:
                if out.params[key] == p and out.shapes[spec.param_template.format(param=key)] == lshape:
                    out.tied[local] = key
                    out.global_names[local] = key
                    continue
                other.append(
                    f"{local}: maps to {key!r} like another parameter of this rank, with placement {p} "
                    f"and shape {list(lshape)} (the other: {out.params[key]}); check the pipeline and tie rules"
                )
                continue
            out.global_names[local] = key
            out.params[key] = p
            out.rules[key] = rule
            full = spec.param_template.format(param=key)
            out.placements[full] = rename_stacked(p, lambda n: spec.param_template.format(param=n))
            out.shapes[full] = lshape
            if rule.average:
                out.averaged[_global_of(full, out.placements[full])] = rule.average
            order.append(key)
        for r in spec.rules:
            if r.index in used:
                continue
            expected = True if r.expect is None else bool(r.expect.eval(env))
            if expected:
                out.unused.append(r)
        problems = (
            [f"no rule matches {n}" for n in unmatched]
            + shape_problems
            + other
        )
        unused_msgs = [f"rule {r} matched no parameter on this rank" for r in out.unused]
        if problems or (strict and unused_msgs):
            raise SpecMismatch(
                f"spec {spec.name!r} does not fit the parameters of rank {_fmt_coords(out.coords)}",
                problems + (unused_msgs if strict else []),
                unmatched=unmatched,
                unused=out.unused,
                shapes=shape_problems,
            )
        if unused_msgs:
            out.warnings.extend(unused_msgs)
            warnings.warn(f"spec {spec.name!r}: " + "; ".join(unused_msgs), stacklevel=2)
        if spec.optimizer is not None:
            self._optimizer(out, env, order)
        return out

    def _optimizer(self, out: ResolvedLayout, env: dict[str, Any], order: list[str]) -> None:
        opt = self.spec.optimizer
        assert opt is not None
        zero = opt.zero.eval(env)
        if zero not in (0, 1, 2, 3):
            raise opt.zero.error(f"optimizer.zero must be 0, 1, 2 or 3, got {zero!r}")

        def state_name(s: str) -> Callable[[str], str]:
            return lambda n: opt.name.format(param=n, state=s)

        def add(k: str, p: Placement, shape: tuple[int, ...]) -> None:
            if k in out.placements:
                raise SpecError(f"optimizer state name {k!r} collides with another state name; check optimizer.name / flat",
                                source=self.spec.src.name)
            out.placements[k] = out.optimizer[k] = p
            out.shapes[k] = shape

        for key in order:  # averaged optimizer states, as consolidated
            axis = out.rules[key].average
            if axis:
                for s in opt.states:
                    out.averaged[state_name(s)(key)] = axis
        if zero == 0:
            for key in order:
                p, shape = out.params[key], out.shapes[self.spec.param_template.format(param=key)]
                for s in opt.states:
                    add(state_name(s)(key), rename_stacked(p, state_name(s)), shape)
            return

        groups: dict[str, list[str]] = {}
        axis_of: dict[str, tuple[str, str]] = {"": ("dp", opt.flat)}
        for g in opt.groups:
            groups[g.name] = []
            axis_of[g.name] = (g.axis, g.flat)
        groups[""] = []
        for key in order:
            gname = next((g.name for g in opt.groups if any(pt.match(key) is not None for pt in g.match)), "")
            groups[gname].append(key)
        align = opt.align.eval(env)
        palign = opt.param_align.eval(env)
        for gname, keys in groups.items():
            if not keys:
                continue
            axis, flat = axis_of[gname]
            size, rank = env[axis], env[f"{axis}_rank"]
            for s in opt.states:
                fn = state_name(s)
                entries = [(fn(k), out.shapes[self.spec.param_template.format(param=k)], rename_stacked(out.params[k], fn)) for k in keys]
                try:
                    if zero == 3:
                        for name, shape, inner in entries:
                            part = L.zero3_param(name, shape, rank, size, inner=inner)
                            add(name, part, (part.numel,))
                    else:
                        part = L.zero_partitions(entries, size, align=align, param_align=palign)[rank]
                        add(flat.format(state=s, group=gname), part, (part.numel,))
                except InvalidPlacement as exc:
                    raise opt.zero.error(f"ZeRO partitions of group {gname or 'default'!r}: {exc}") from None


def _global_of(name: str, p: Placement) -> str:
    return p.name if isinstance(p, Stacked) and p.name else name


def _fmt_coords(c: Mapping[str, int]) -> str:
    return "(" + ", ".join(f"{k[:-5]} {v}" for k, v in sorted(c.items())) + ")"
