"""Import Megatron-DeepSpeed's ``universal_checkpoint_info`` pattern lists into a spec.

DeepSpeed's ``ds_to_universal`` decides how to merge each parameter's tensor-parallel slices
from regular-expression lists (matched with ``re.match``: anchored at the start only), checked
in this order, the first that matches winning:

    tp_replicated_parameter_patterns          -> replicated (keep one slice)
    parameter_to_average_patterns             -> average(tp)
    parameter_with_2_sub_params_cat_dim_0     -> fused(0, 2, shard(0, tp))
    parameter_with_sub_params (SubparamShape) -> fused(d, [sizes], shard(d, tp)) : [shape]
    parameter_with_row_parallelism_patterns   -> shard(1, tp)
    (anything else)                           -> shard(0, tp)
and, on top of any of these, vocabulary_parameter_patterns drop the padding rows beyond
``original_vocab_size``: ``padded(0, vocab, <the placement above>)``.

:func:`from_deepspeed` writes the same decisions as spec rules, in that order: a pattern ``P``
becomes ``re:(?:P).*`` (whole-name match == ``re.match``), a vocabulary pattern ``V`` that meets
another list's pattern ``R`` becomes ``re:(?=(?:V))(?:R).*`` (both must match) ahead of the
rest, and a final catch-all carries the default. Rules only DeepSpeed's order needs (the
combinations and the catch-all) are not expected to match (``expect = 0``); the lists' own
rules are expected on every rank when there is no pipeline (``expect = "pp == 1"``: a stage
holds only its layers) — ``ucpd.ucl.spec.explain`` checks them over a whole checkpoint.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .errors import SpecError
from .spec import Spec, spec_from_dict

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
VOCABULARY = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED = "pipeline_replicated_parameter_patterns"
TP_REPLICATED = "tp_replicated_parameter_patterns"
TO_AVERAGE = "parameter_to_average_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PADDED_VOCAB_SIZE = "padded_vocab_size"
_KNOWN = {VOCABULARY, PIPELINE_REPLICATED, TP_REPLICATED, TO_AVERAGE, ROW_PARALLEL, TWO_SUB_PARAMS,
          SUB_PARAMS, ORIGINAL_VOCAB_SIZE, PADDED_VOCAB_SIZE, "universal_checkpoint_version"}


def _patterns(info: Mapping[str, Any], key: str) -> list[str]:
    v = info.get(key) or []
    if isinstance(v, str) or not isinstance(v, Sequence) or not all(isinstance(p, str) for p in v):
        raise SpecError(f"universal_checkpoint_info[{key!r}] must be a list of regular expressions, got {v!r}")
    return list(v)


def _rx(p: str) -> str:
    return f"re:(?:{p}).*"


def _sub_param_rule(s: Any, j: int) -> tuple[list[str], str]:
    """(patterns, placement text) of one SubparamShape (a dict, or an object with the fields)."""
    get = (lambda k: s.get(k)) if isinstance(s, Mapping) else (lambda k: getattr(s, k, None))
    patterns, shape, pdim = get("patterns"), get("shape"), get("partition_dim")
    where = f"universal_checkpoint_info[{SUB_PARAMS!r}][{j}]"
    if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not patterns:
        raise SpecError(f"{where}: patterns must be a list of regular expressions")
    if not isinstance(shape, Sequence) or not isinstance(pdim, int) or not 0 <= pdim < len(shape):
        raise SpecError(f"{where}: needs shape (a list) and partition_dim (an index into it)")
    sizes = shape[pdim]
    sizes = list(sizes) if isinstance(sizes, Sequence) else [sizes]
    if not sizes or not all(isinstance(n, int) and n > 0 for n in sizes):
        raise SpecError(f"{where}: shape[{pdim}] must hold the sub-parameters' sizes, got {shape[pdim]!r}")
    gshape = [sum(sizes) if i == pdim else d for i, d in enumerate(shape)]
    if not all(isinstance(d, int) for d in gshape):
        raise SpecError(f"{where}: shape entries other than shape[partition_dim] must be integers")
    text = f"fused({pdim}, [{', '.join(map(str, sizes))}], shard({pdim}, tp)) : [{', '.join(map(str, gshape))}]"
    return list(patterns), text


def from_deepspeed(
    info: Mapping[str, Any],
    *,
    name: str = "deepspeed",
    zero: int | None = None,
    align: int = 2,
    states: Sequence[str] = ("exp_avg", "exp_avg_sq"),
    param_template: str = "model.{param}",
) -> Spec:
    """A spec with the decisions of a Megatron-DeepSpeed ``universal_checkpoint_info`` dict
    (the dict itself, or a model-states dict holding it under ``universal_checkpoint_info``).

    ``zero`` adds an ``[optimizer]`` table (ZeRO stage; ``align`` 2 is DeepSpeed's partition
    padding; ``states`` the optimizer states). Binds ``vocab`` to ``original_vocab_size``.
    ``spec.to_toml()`` writes the result as a spec file to edit. Raises SpecError for a
    malformed dict.
    """
    if UNIVERSAL_CHECKPOINT_INFO in info and isinstance(info[UNIVERSAL_CHECKPOINT_INFO], Mapping):
        info = info[UNIVERSAL_CHECKPOINT_INFO]
    vocab = _patterns(info, VOCABULARY)
    replicated = _patterns(info, TP_REPLICATED)
    average = _patterns(info, TO_AVERAGE)
    row = _patterns(info, ROW_PARALLEL)
    two = _patterns(info, TWO_SUB_PARAMS)
    subs = info.get(SUB_PARAMS) or []
    if not isinstance(subs, Sequence):
        raise SpecError(f"universal_checkpoint_info[{SUB_PARAMS!r}] must be a list")
    rules: dict[str, Any] = {}
    expected = "pp == 1"

    def add(key: str, placement: str, expect: Any, note: str) -> None:
        if key not in rules:  # the same pattern in two lists: the earlier list wins, as in DeepSpeed
            rules[key] = {"placement": placement, "expect": expect, "note": note}

    symbols: dict[str, Any] = {}
    if vocab:
        if not isinstance(info.get(ORIGINAL_VOCAB_SIZE), int):
            raise SpecError(f"universal_checkpoint_info has {VOCABULARY} but no integer {ORIGINAL_VOCAB_SIZE}")
        symbols["vocab"] = info[ORIGINAL_VOCAB_SIZE]
        for v in vocab:  # a vocabulary parameter that another list also names
            for plist, placement in ((replicated, "replicated"), (average, "replicated"), (row, "shard(1, tp)")):
                for r in plist:
                    add(f"re:(?=(?:{v}))(?:{r}).*", f"padded(0, vocab, {placement})", 0, "vocabulary, and " + r)
    for p in replicated:
        add(_rx(p), "replicated", expected, TP_REPLICATED)
    for p in average:
        add(_rx(p), "average(tp)", expected, TO_AVERAGE)
    for p in two:
        add(_rx(p), "fused(0, 2, shard(0, tp))", expected, TWO_SUB_PARAMS)
    for j, s in enumerate(subs):
        pats, text = _sub_param_rule(s, j)
        for p in pats:
            add(_rx(p), text, expected, SUB_PARAMS)
    for p in row:
        add(_rx(p), "shard(1, tp)", expected, ROW_PARALLEL)
    for v in vocab:
        add(_rx(v), "padded(0, vocab, shard(0, tp))", expected, VOCABULARY)
    add("re:.*", "shard(0, tp)", 0, "DeepSpeed's default: tensor-parallel slices concatenated on dim 0")
    extra = sorted(k for k in info if k not in _KNOWN)
    desc = "imported from Megatron-DeepSpeed universal_checkpoint_info"
    pipe = _patterns(info, PIPELINE_REPLICATED)
    if pipe:
        desc += f"; pipeline-replicated (one global tensor, held by several stages): {', '.join(pipe)}"
    if extra:
        desc += f"; keys not imported: {', '.join(extra)}"
    d: dict[str, Any] = {"spec": {"name": name, "description": desc, "version": 1}}
    if symbols:
        d["symbols"] = symbols
    d["names"] = {"param": param_template}
    d["rules"] = rules
    if zero is not None:
        d["optimizer"] = {"states": list(states), "zero": int(zero), "align": int(align),
                          "name": "optim.{param}.{state}", "flat": "optim.{state}"}
    return spec_from_dict(d, source=f"<{name}>")
