"""UCL spec files: describe a model family's layout once, get every rank's placements.

    from ucpd.ucl.spec import load_spec, RankCoords

    spec = load_spec("megatron-gpt")                      # a shipped family, or a .toml/.json path
    bound = spec.bind(tp=2, pp=2, dp=2, vocab=50257, hidden=1024, heads=16, layers=24, ffn=4096)
    lay = bound.placements(RankCoords(tp_rank=1, pp_rank=0, dp_rank=1), params={name: p.shape, ...})
    ckpt.snapshot(step, {"model": lay.rename(params), "optim": ...}, placements=lay.placements)

A spec maps parameter-name patterns to UCL placements in a short text form
(``"layers.*.mlp.fc2.weight" = "shard(1, tp)"``), with symbols bound from the run's
configuration, a pipeline renumbering rule, tied weights and the optimizer's ZeRO rule.
``docs/UCL.md`` ("Spec files") describes the language; :mod:`.explain` shows which rule each
tensor of a checkpoint followed; :func:`from_deepspeed` imports Megatron-DeepSpeed's
``universal_checkpoint_info`` pattern lists.

Importing this package needs numpy only; pipeline offsets and ZeRO partitions come from
``ucpd.ucl.layouts``.
"""

from .deepspeed import from_deepspeed
from .errors import SpecError, SpecMismatch, TextError
from .layout import BoundSpec, RankCoords, ResolvedLayout, rename_stacked
from .patterns import NamePattern, compile_pattern
from .spec import Rule, Spec, list_specs, load_spec, loads_spec, spec_from_dict
from .syntax import (
    format_placement,
    format_rule,
    parse_expr,
    parse_placement,
    parse_rule,
)

__all__ = [
    "BoundSpec", "NamePattern", "RankCoords", "ResolvedLayout", "Rule", "Spec", "SpecError",
    "SpecMismatch", "TextError", "compile_pattern", "format_placement", "format_rule",
    "from_deepspeed", "list_specs", "load_spec", "loads_spec", "parse_assignments",
    "parse_expr", "parse_placement", "parse_rule", "rename_stacked", "spec_from_dict",
]


def parse_assignments(items: list[str] | tuple[str, ...] | None) -> dict[str, int | float]:
    """``["tp=2", "vocab=50257", "tie=true"]`` (the CLI's ``--set k=v``) -> keyword arguments
    for ``Spec.bind``. Raises SpecError for a malformed item."""
    out: dict[str, int | float] = {}
    for item in items or ():
        k, sep, v = item.partition("=")
        k, v = k.strip(), v.strip()
        if not sep or not k.isidentifier():
            raise SpecError(f"--set {item!r}: expected name=value, e.g. tp=2")
        low = v.lower()
        if low in ("true", "false"):
            out[k] = int(low == "true")
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                raise SpecError(f"--set {item!r}: {v!r} is not a number") from None
    return out
