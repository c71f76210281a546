"""transformers' checkpoint names, read as laden's key map.

transformers 5 renames checkpoint names when it loads them and fuses some
tensors (each MoE layer's per-expert tensors into one parameter: gate and
up of each expert in turn, stacked over the experts).  Its rules are the
model's conversion mapping; ``save_pretrained`` writes the checkpoint back
in the form before them.  Here those rules become a key map for laden's
loader: a checkpoint name to the model name it loads into, or to
``(model name, k)`` for the k-th piece of a tensor laid end to end from
several checkpoint tensors (C joins them while reading:
laden_sched_join_tensor).  A conversion that is not pieces laid end to end
(a transpose, a concatenation along an inner dimension, a split) is
refused naming it.  Nothing here reads or decides memory: it names.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple, Union

from .errors import InvalidArgumentError

__all__ = ["key_map_for"]

Target = Union[None, str, Tuple[str, int]]


def _is_transformers(model) -> bool:
    return any(c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def _natural(name: str):
    """Sort key: digits as numbers (experts 2 before 10), as transformers
    orders a checkpoint's names before it stacks them."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p)
            for p in name.split(".")]


def _rules(model):
    """(renamings, converters, rename_source_key) for the model, or None
    where transformers has no conversion mapping (4.x: names as
    stored)."""
    try:
        from transformers import conversion_mapping as cm
        from transformers.core_model_loading import (WeightConverter,
                                                     WeightRenaming,
                                                     rename_source_key)
        rules = cm.get_model_conversion_mapping(model) or []
    except Exception:
        return None
    return ([r for r in rules if isinstance(r, WeightRenaming)],
            [r for r in rules if isinstance(r, WeightConverter)],
            rename_source_key)


def _op(o) -> Tuple[str, Optional[int]]:
    return type(o).__name__, getattr(o, "dim", None)


def _pieces(model, target: str, conv, by_pattern: Dict[str, List[str]]
            ) -> List[str]:
    """The checkpoint names of converter `conv`'s target, in the order
    their bytes lie in the target; InvalidArgumentError when the
    conversion is not pieces laid end to end."""
    ops = [_op(o) for o in getattr(conv, "operations", [])]
    pats = [p for p in conv.source_patterns if p in by_pattern]
    lists = [by_pattern[p] for p in pats]
    if ops == [("MergeModulelist", 0)] and len(lists) == 1:
        return list(lists[0])  # stacked: expert e is piece e
    if ops == [("MergeModulelist", 0), ("Concatenate", 1)] and \
            len({len(x) for x in lists}) == 1:
        # Stacked per pattern, then concatenated along the rows of each
        # expert: expert e's rows of every pattern in turn.
        return [x[e] for e in range(len(lists[0])) for x in lists]
    if ops == [("Concatenate", 0)] and all(len(x) == 1 for x in lists):
        return [x[0] for x in lists]
    names = [n for x in lists for n in x]
    raise InvalidArgumentError(
        f"{type(model).__name__}: transformers makes '{target}' from "
        f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} with "
        f"{' then '.join(f'{n}(dim={d})' for n, d in ops) or 'no operation'}"
        ", which laden cannot apply while reading (it lays checkpoint "
        "tensors end to end: experts stacked, their rows concatenated); "
        "load a checkpoint saved in the model's own names (its "
        "state_dict) instead", "E_INVAL")


def _peft_base(model):
    """The model a peft PeftModel wraps (its base_model.model), or None
    for a model that is not peft's."""
    if getattr(model, "peft_config", None) is None:
        return None
    inner = getattr(getattr(model, "base_model", None), "model", None)
    return inner if inner is not None and inner is not model else None


def peft_key_map(model, names: List[str]) -> Optional[Dict[str, Target]]:
    """A peft model built over a base the checkpoint `names` hold: each
    base name (after the base model's own renames, key_map_for) mapped to
    where peft keeps it ("base_model.model." before it, ".base_layer"
    inside the layers it wraps), so that the base loads into the peft
    model as into the base.  None for a model that is not peft's."""
    base = _peft_base(model)
    if base is None:
        return None
    inner = key_map_for(base, names) or {}
    where: Dict[str, str] = {}
    for n in model.state_dict().keys():
        if ".lora_" in n or n.startswith("lora_"):
            continue
        plain = n[len("base_model.model."):] \
            if n.startswith("base_model.model.") else n
        where.setdefault(plain.replace(".base_layer.", "."), n)
    out: Dict[str, Target] = {}
    for n in names:
        to = inner.get(n, n)
        if to is None:
            out[n] = None
        elif isinstance(to, tuple):
            out[n] = (where.get(to[0], to[0]), to[1])
        else:
            out[n] = where.get(to, to)
    return out


def key_map_for(model, names: List[str]) -> Optional[Dict[str, Target]]:
    """The key map that loads checkpoint `names` into transformers model
    `model` as transformers would (its renames, its fused tensors, the
    base model's prefix taken off or put on), or None when there is
    nothing to map (not a transformers model, or names as the model's).
    A name transformers would not place maps to its renamed form, so a
    mismatch names it."""
    if not _is_transformers(model):
        return None
    want = dict.fromkeys(model.state_dict().keys(), True)
    rules = _rules(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    if rules is None:
        return _prefix_map(names, want, prefix)
    renamings, converters, rename = rules
    by_source = {p: c for c in converters for p in c.source_patterns}
    # A checkpoint of the model with its head loaded into the base model:
    # the head's tensors have no place and are dropped (transformers
    # ignores them too).
    headless = _prefix_side(names, want, prefix) == "strip"
    out: Dict[str, Target] = {}
    fused: Dict[str, Dict[str, List[str]]] = {}
    conv_of: Dict[str, object] = {}
    for n in sorted(names, key=_natural):
        to, pat = rename(n, renamings, converters, prefix or None, want)
        if to not in want and n in want:  # as stored after all
            to, pat = rename(n, [], [], prefix or None, want)
        if to not in want and headless:
            out[n] = None
            continue
        if pat is None or to not in want:
            out[n] = to
            continue
        fused.setdefault(to, {}).setdefault(pat, []).append(n)
        conv_of[to] = by_source[pat]
    for to, by_pattern in fused.items():
        for k, n in enumerate(_pieces(model, to, conv_of[to], by_pattern)):
            out[n] = (to, k)
    if all(out[n] == n for n in names):
        return None
    return out


def _prefix_map(names: List[str], want: dict, prefix: str
                ) -> Optional[Dict[str, Target]]:
    """Older transformers: a checkpoint saved from the model with its head
    loads into the base model and back (the base model's prefix taken off
    or put on when only one side has it)."""
    side, p = _prefix_side(names, want, prefix), prefix + "."
    out: Dict[str, Target] = {}
    if side == "strip":
        for n in names:
            if n.startswith(p) and n[len(p):] in want:
                out[n] = n[len(p):]
            elif n not in want:
                out[n] = None  # the head's tensors: dropped
    elif side == "add":
        out = {n: p + n for n in names}
    return out or None


def _prefix_side(names: List[str], want: dict, prefix: str
                 ) -> Optional[str]:
    """Which side has the base model's prefix when only one does: "strip"
    (most checkpoint names have it, no model name does: a checkpoint with
    its head loaded into the base model), "add" (the reverse), or None."""
    if not prefix:
        return None
    p = prefix + "."
    ck_pre = sum(n.startswith(p) for n in names)
    mod_pre = sum(n.startswith(p) for n in want)
    if ck_pre > len(names) // 2 and mod_pre == 0:
        return "strip"
    if ck_pre == 0 and mod_pre > len(want) // 2:
        return "add"
    return None
