"""Routing params to optimizer families (Megatron-Core's per-group ``optimizer`` key).

``build_family_param_groups`` runs ``overrides.build_param_groups`` and gives each group the family that
updates it (``optimizer="muon"``: 2-D hidden matrices to Muon, the rest to ``muon_scalar_optimizer``).
Megatron-Core's rule reads marks that Hugging Face, timm and plain torch models do not set, so it would
orthogonalise their embeddings, tied heads and fused QKV weights. When no trainable param carries a mark,
graphstep infers them: embedding weights and anything tied to them, 2-D params named like an embedding or a
head, and torch's ``in_proj_weight`` split as [W_q; W_k; W_v]; another fused QKV weight is refused, naming the
ways out. A model with any of Megatron's marks is routed by them alone. Inferred routing is logged as a WARNING.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from ..families import FAMILIES, family_name, get_family, group_keys
from ..kernels.muon import QKVSplit
from .model_params import as_chunks
from .overrides import build_param_groups, get_standard_config_overrides

logger = logging.getLogger("graphstep")

# Name components that mean an embedding or an output head (GPT-2's wte/wpe, HF's lm_head, GPT-NeoX's
# embed_out, Megatron's output_layer); any component containing "embed" (embed_tokens, word_embeddings,
# position_embeddings, ...) too. Kept short on purpose: a miss shows in the routing log line.
EMBEDDING_OR_HEAD_PARTS = ("wte", "wpe", "lm_head", "embed_out", "output_layer")
EMBEDDING_SUBSTRING = "embed"
# A model's own top-level head (torchtitan's `output`, timm's `head`, HF's `classifier`); deeper modules
# with these names (BERT's attention.output) are hidden layers.
TOP_LEVEL_HEADS = ("output", "head", "classifier")
# Modules whose weight holds Q, K and V in one matrix: GPT-2's c_attn (HF Conv1D: Q, K, V are columns),
# timm's qkv, Phi-3's qkv_proj, GPT-NeoX's query_key_value, MPT's Wqkv, Baichuan's W_pack.
FUSED_QKV_MODULES = ("c_attn", "qkv", "qkv_proj", "query_key_value", "Wqkv", "W_pack")
TORCH_MHA_IN_PROJ = "in_proj_weight"
MEGATRON_MARKS = ("is_embedding_or_output_parameter", "shared_embedding")
_LOGGED_NAMES = 3  # names shown per family in the routing line


@dataclass(frozen=True)
class _ModelFacts:
    """What routing knows of the model beyond each param's own name."""

    marked: bool  # some trainable param carries one of Megatron's marks: route by the marks alone
    aliases: Mapping[int, tuple[str, ...]]  # id(param) -> every name it is reached under (ties)
    embedding_ids: frozenset  # ids of nn.Embedding / nn.EmbeddingBag weights


def build_family_param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], config,
                              config_overrides: Optional[dict] = None, model_chunks=None) -> list[dict]:
    """``build_param_groups``, then each param routed to its optimizer family through the group key
    ``optimizer`` (Megatron-Core's per-group key), with that family's hyperparameters in the group.

    Routing, as Megatron-Core does it: with ``optimizer="muon"``, 2-D params go to "muon" unless they are
    embedding/output params (``is_embedding_or_output_parameter`` or ``shared_embedding``) or carry
    ``use_muon=False``; the rest go to ``muon_scalar_optimizer``. On a model without those marks they are
    inferred (module docstring), from the modules when ``model_chunks`` (what ``named_params`` came from)
    is given, else from the names alone. An override may name a param's family itself
    (``{ParamKey(...): {"optimizer": "adam"}}``), for any ``config.optimizer``; a key setting it takes
    precedence over the rule. For "adam" and "sgd" without such overrides the groups are those of
    ``build_param_groups``, unchanged (no ``optimizer`` key).

    Family hyperparameters: each family's ``group_defaults`` (graphstep/families/: Muon groups
    ``momentum``, live, so torch's OneCycleLR may cycle it; Lion groups ``betas`` = (``lion_beta1``,
    ``lion_beta2``); Adam groups ``betas``; SGD groups ``momentum``/``nesterov``). Groups keep
    ``build_param_groups``'s order; a group split between families becomes one group per family, in the
    order its params first appear. A family name that is not registered raises, naming it.
    """
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    chosen: dict = {}  # ParamKey -> family name, from overrides that set "optimizer"
    stripped: dict = {}
    for key, override in (config_overrides.items() if isinstance(config_overrides, dict) else ()):
        if isinstance(override, dict) and "optimizer" in override:
            try:  # another spelling of a family ("adamw"): the family's own name
                family = family_name(override["optimizer"], config)
            except ValueError as exc:
                raise ValueError(f"override for {key}: {exc}") from None
            if family not in FAMILIES:
                raise ValueError(f"override for {key}: optimizer={family!r} must be one of "
                                 f"{', '.join(map(repr, FAMILIES))}")
            chosen[key] = family
            override = {k: v for k, v in override.items() if k != "optimizer"}
            if not override:
                continue  # it only picks the family: no group of its own (an empty override would make one)
        stripped[key] = override
    groups = build_param_groups(named_params, config, stripped if isinstance(config_overrides, dict)
                                else config_overrides)
    base = get_family(config.optimizer)
    if base.torch_shaped_groups and not chosen:
        return groups  # build_param_groups already gave them the family's keys, and no "optimizer" key

    facts = _model_facts(named_params, model_chunks)
    inferred: dict[str, str] = {}  # param name -> why it went to the scalar optimizer without a mark

    def family_of(param, name: str) -> str:
        picked = {family for key, family in chosen.items() if key.matches(param, name)}
        if len(picked) > 1:
            raise ValueError(f"param '{name}': overrides route it to several optimizers {sorted(picked)}; make the "
                             "keys disjoint")
        if picked:
            return picked.pop()
        if base.matrices is None:  # the family takes every param
            return base.name
        if not base.matrices.takes(param):
            return base.matrices.scalar_family(config)
        reason = None if facts.marked else _embedding_or_head_reason(param, name, facts)
        if reason is not None:
            inferred[name] = reason
            return base.matrices.scalar_family(config)
        return base.name

    routed = []
    for group in groups:
        by_family: dict[str, dict] = {}
        for param, name in zip(group["params"], group["param_names"]):
            family = family_of(param, name)
            if family not in by_family:
                by_family[family] = _family_group(config, group, family)
            by_family[family]["params"].append(param)
            by_family[family]["param_names"].append(name)
        routed += by_family.values()
    split = [] if facts.marked else _split_or_refuse_fused_qkv(routed, config)
    _log_routing(config, routed, inferred, split)
    return routed


# ---- marks inferred on models without Megatron's ----------------------------------------------------------

def _model_facts(named_params, model_chunks) -> _ModelFacts:
    """Whether the model is Megatron-marked, each param's names (ties included) and its embedding weights.
    Names follow the engine's (graphstep.model_params): several chunks' names are prefixed with the index."""
    marked = any(getattr(param, mark, False) for _, param in named_params for mark in MEGATRON_MARKS)
    if model_chunks is None:
        return _ModelFacts(marked, {id(param): (name,) for name, param in named_params}, frozenset())
    chunks = as_chunks(model_chunks)
    aliases: dict[int, tuple[str, ...]] = {}
    embedding_ids = set()
    for c, chunk in enumerate(chunks):
        prefix = "" if len(chunks) == 1 else f"{c}."
        for name, param in chunk.named_parameters(remove_duplicate=False):
            aliases[id(param)] = aliases.get(id(param), ()) + (prefix + name,)
        embedding_ids |= {id(module.weight) for module in chunk.modules()
                          if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
    return _ModelFacts(marked, aliases, frozenset(embedding_ids))


def named_like_embedding_or_head(name: str) -> bool:
    """Whether a param's dotted name says embedding or output head (the lists at the top of this module)."""
    parts = name.split(".")
    return (any(EMBEDDING_SUBSTRING in part.lower() or part in EMBEDDING_OR_HEAD_PARTS for part in parts)
            or (len(parts) > 1 and parts[0] in TOP_LEVEL_HEADS))


def _embedding_or_head_reason(param, name: str, facts: _ModelFacts) -> Optional[str]:
    """Why an unmarked 2-D param is an embedding or output head, in words for the log; None if it is not."""
    names = facts.aliases.get(id(param), (name,))
    tie = [other for other in names if other != name]
    tied = f", tied as {', '.join(tie)}" if tie else ""
    if id(param) in facts.embedding_ids:
        return f"nn.Embedding{tied}"
    if any(named_like_embedding_or_head(n) for n in names):
        return f"named like an embedding/output head{tied}"
    return None


def fused_qkv_kind(name: str, param) -> Optional[str]:
    """"torch" for nn.MultiheadAttention's in_proj_weight, "named" for a weight of a FUSED_QKV_MODULES
    module, None for anything else."""
    parts = name.split(".")
    if param.ndim != 2:
        return None
    if parts[-1] == TORCH_MHA_IN_PROJ:
        return "torch"
    return "named" if len(parts) > 1 and parts[-1] == "weight" and parts[-2] in FUSED_QKV_MODULES else None


def _split_or_refuse_fused_qkv(routed: list[dict], config) -> list[str]:
    """Give torch's in_proj_weight left to Muon its known split; refuse any other fused QKV weight left to
    Muon without a ``qkv_split`` (its layout is unknown). Returns the names given a split. (A family splits
    fused QKV weights when its ``splits_fused_qkv(config)`` says so: Muon with ``MuonOptions.split_qkv``; without
    it the user asked for fused weights orthogonalised whole, as Megatron-Core allows.)"""
    known, unknown = [], []
    for group in routed:
        if not get_family(group["optimizer"]).splits_fused_qkv(config):
            continue
        for param, name in zip(group["params"], group["param_names"]):
            kind = fused_qkv_kind(name, param)
            if kind is None or getattr(param, "qkv_split", None) is not None:
                continue
            rows, cols = param.shape
            (known if kind == "torch" and rows == 3 * cols else unknown).append((name, param))
    if unknown:
        raise ValueError(_fused_qkv_refusal(unknown))
    for name, param in known:  # rows [W_q; W_k; W_v], each embed_dim (torch's nn.MultiheadAttention)
        param.qkv_split = QKVSplit(1, param.shape[1], param.shape[1], param.shape[1])
    return [name for name, _ in known]


def _fused_qkv_refusal(unknown: list) -> str:
    name, param = unknown[0]
    others = f" (and {len(unknown) - 1} more: {', '.join(n for n, _ in unknown[1:4])}" \
             f"{', ...' if len(unknown) > 4 else ''})" if len(unknown) > 1 else ""
    glob = "*" + ".".join(name.split(".")[-2:])
    if param.shape[1] > param.shape[0]:  # more columns than rows: Q, K and V side by side
        layout = ("its Q, K and V are columns (Hugging Face's Conv1D stores weights as (in, out)), which "
                  "graphstep.QKVSplit (rows) cannot describe. ")
        split = ""
    else:
        layout = "its head layout cannot be read off the tensor. "
        split = ("or mark its split before get_optimizer: param.qkv_split = graphstep.QKVSplit(num_groups, "
                 "q_rows, k_rows, v_rows) (QKVSplit(1, d, d, d) for rows [Q; K; V]); ")
    return (f"param '{name}'{others} of shape {tuple(param.shape)} looks like a fused QKV weight (Q, K and V in "
            "one matrix). With optimizer='muon' and muon_split_qkv=True, Muon orthogonalises Q, K and V as "
            f"separate matrices, but {layout}Route it to the scalar optimizer: config_overrides={{**graphstep."
            f"get_standard_config_overrides(config), graphstep.ParamKey(name='{glob}'): {{'optimizer': 'adam'}}}}; "
            f"{split}or set muon_split_qkv=False to orthogonalise it whole")


# ---- the routing, told once per build ------------------------------------------------------------------

def _log_routing(config, routed: list[dict], inferred: dict, split: list) -> None:
    """One line: each family's param count and a few names (inferred ones first, with their reason).
    WARNING when something was inferred, so a user sees it without configuring logging; else INFO."""
    names: dict[str, list[str]] = {}
    for group in routed:
        names.setdefault(group["optimizer"], []).extend(group["param_names"])
    if len(names) < 2:
        return
    parts = []
    for family, members in names.items():
        ordered = [n for n in members if n in inferred] + [n for n in members if n not in inferred]
        shown = [f"{n} [{inferred[n]}]" if n in inferred else n for n in ordered[:_LOGGED_NAMES]]
        more = f", ... {len(members) - len(shown)} more" if len(members) > len(shown) else ""
        parts.append(f"{family} {len(members)} params ({', '.join(shown)}{more})")
    line = f"graphstep: optimizer={config.optimizer!r} routing: " + "; ".join(parts)
    if not (inferred or split):
        logger.info(line)
        return
    told = []
    if inferred:
        told.append(f"{len(inferred)} embedding/output params recognised by module, tie or name went to "
                    f"{get_family(config.optimizer).matrices.scalar_family(config)}")
    if split:
        told.append(f"{len(split)} nn.MultiheadAttention in_proj_weight split as [W_q; W_k; W_v] for Muon")
    logger.warning("%s. The model carries none of Megatron's marks (%s), so %s. To route a param otherwise, mark "
                   "it (is_embedding_or_output_parameter, use_muon=False) or route it with config_overrides "
                   "{gs.ParamKey(name=...): {'optimizer': ...}}", line, ", ".join(MEGATRON_MARKS), "; ".join(told))


def _family_group(config, group: dict, family: str) -> dict:
    """A copy of ``group`` (no params) for ``family``, with that family's hyperparameters only: it sheds
    every family's group keys, then takes its own (``Family.group_defaults``)."""
    defaults = get_family(family).group_defaults(config)
    shed = ("params", "param_names") + group_keys(config)
    new = {k: v for k, v in group.items() if k not in shed}
    new.update(params=[], param_names=[], optimizer=family, overrides={**group["overrides"], "optimizer": family})
    new.update(defaults)
    return new
