"""How each format lays out a model family: the format's rules applied to a family's tensors.

A layout spec is named ``<format>-<family>[-<option>...]`` (``megatron-llama-tied-distopt-torch``,
``hf-gpt2``, ``dcp-mixtral``) and generated on request from the family (``reshard.models``) and the
rules below; no format keeps a copy of a family. ``spec_text(name)`` gives the text (what
``plan --explain`` and error carets show), ``layout_spec(name)`` the parsed spec; a path names a
user's own spec file instead.

The rules, per format:

- ``hf``: every tensor under its Hugging Face name, unsharded, as Hugging Face stores it.
- ``deepspeed`` (ZeRO-1/2, ``engine.save_checkpoint``): the module's state dict, each tensor as the
  model holds it (GPT-2's Conv1D weights ``[in, out]``, as Hugging Face stores them; transformers 5's fused
  experts, ``Family.module``), and one flat buffer
  per param group and state: the group's params flattened in registration order, zero-padded to a
  multiple of ``2 * dp`` (``nccl_start_alignment_factor``) and split into dp equal partitions. An
  always-tied family's output projection (``tied_head``) is in the module's state dict as a copy of the
  embedding (section ``module``: ``lm_head.weight -> embed``), in no flat buffer; a family's persistent buffers
  are in the module's state dict too (section ``buffers``, named in ``buffer_names``; under ``zero3`` whole in
  every rank's model file), in no flat buffer. Options:
  ``hf-trainer`` (two param groups, decay and no decay, as transformers' Trainer makes them),
  ``zero3`` (every param padded and split on its own), and the ``deepspeed-pipe`` prefix for the
  pipeline engine (``PipelineModule`` of [embedding, decoder layers, norm, head]: params named
  ``<layer index>.<name in the layer>``, tensor-parallel splits of the family's plan).
- ``dcp``: FSDP2 (``fully_shard``) over dp and the family's DTensor tensor-parallel plan over tp
  (``ColwiseParallel`` splits the output features, ``RowwiseParallel`` the input ones): dim 0 of every tensor of
  the module's state dict (``Family.module_tensors``, as the module holds it: GPT-2's Conv1D weights ``[in, out]``)
  chunked over dp with ``torch.chunk`` sizes, after tp where tp splits it too (``_StridedShard``); the persistent
  buffers whole (section ``buffers``); a tied model's output projection, ``lm_head.weight``, a copy of the
  embedding with no optimizer state of its own (section ``tied``; option ``tied`` where the family may tie).
- ``megatron`` (Megatron-core, torch format): the family's Megatron names and fusions, and with
  ``distopt`` the distributed optimizer's buffers: params (not the family's persistent buffers) in reverse
  registration order, each at a multiple of 64 elements, closed into buckets, padded for dp; ``-torch`` as
  ``distrib_optim.pt`` holds them (coalesced per (tp, pp)), without it per dp rank; ``-ep`` gives experts their
  own buffer; ``mtp`` adds the multi-token-prediction layers of a family that has them (size ``hf_layers``);
  ``etp`` splits the routed experts over etp instead of tp (``--expert-tensor-parallel-size``; a unit's etp rank
  is its tp rank mod etp, whole experts at etp 1). The
  ``megatron-legacy`` prefix is Megatron-LM's legacy model.
- ``mcore-dist`` (Megatron-core ``torch_dist``): the family's ``megatron`` layout with each tensor whole: no tp
  split, layers stacked on a leading dim ``{i}`` (or, for layers of several kinds, DeepSeek-V3's dense and MoE
  ones, each keyed by its global number: ``decoder.layers.{m}.``), SequentialMLP experts on the next leading
  dim ``{e}`` (numbered globally, no ep split), the vocabulary padded to ``vpad`` rows, a tied output layer not
  stored (it is the embedding's key). Options ``tied``, ``local`` (megatron-core's local layers, which key the
  norms of fused-QKV attention as the next linear's ``layer_norm_weight``: the same layout for dense families,
  not for MoE ones; MLA's keep their module names), ``mtp`` (the MTP block, ``mtp.layers.{k}.``) and ``grouped``
  (the legacy GroupedMLP experts: the same rules, megatron-core saves them under SequentialMLP's keys; the
  args and the distributed optimizer's buckets follow ``megatron-<family>-grouped``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from reshard.core.spec import Spec, parse_spec
from reshard.errors import CheckpointFormatError, SpecError
from reshard.models import FAMILIES, Family, get_family, known_family
from reshard.models.family import Tensor
from reshard.models.catalog import load_spec
from reshard.models.config import hf_config

__all__ = ["BUFFERS", "FORMAT_RULES", "TIED", "TIED_HEAD", "layout_spec", "require_family", "spec_names", "spec_text", "tied_embedding", "tied_head"]

STATES = "states master exp_avg exp_avg_sq"
DISTOPT = "reverse | align 64 | buckets bucket_size"


def _split_dims(dims: str) -> list[str]:
    """Top-level terms of a dims text: ``(g qpg hd) h`` -> ``['(g qpg hd)', 'h']``."""
    out, depth, cur = [], 0, ""
    for ch in dims.strip():
        if ch == " " and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
            continue
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        cur += ch
    return out + ([cur] if cur else [])


def _with(dims: str, at: int, suffix: str) -> str:
    terms = _split_dims(dims)
    terms[at] += suffix
    return " ".join(terms)


def _layer_local(name: str) -> str:
    """A decoder layer's name numbered by stage (``{i/pp}``: a block of rules repeated layer by layer), whichever
    index names it: ``i``, or DeepSeek-V3's dense ``d`` and MoE ``m`` layers."""
    return re.sub(r"\{([idm])\}", r"{\1/pp}", name)


# --- hf ----------------------------------------------------------------------------------------------

def hf(family: Family, options: tuple[str, ...]) -> str:
    tied = _flag(options, "tied", family)
    lines = [family.logical_text(tied), "section model"]
    lines += [f"{t.name} = {t.hf_dims or t.dims}" for t in _hf_order(family, tied)]
    return "\n".join(lines) + "\n"


def _hf_order(family: Family, tied: bool):
    stored = {t.alias: t for t in family.stored(tied)}
    return [stored[a] for a in family.hf_order if a in stored] if family.hf_order else list(stored.values())


# --- deepspeed ---------------------------------------------------------------------------------------

BUFFERS = "buffers"
"""The section of a family's DeepSpeed layout that holds its persistent buffers: in the module's state dict
(``buffer_names``), in no flat buffer."""


def _buffers(family: Family) -> list[Tensor]:
    """The family's persistent buffers (``Family.buffers``), in the order it stores them."""
    return [t for t in family.stored(tied=False) if t.alias in family.buffers]


TIED_HEAD = "lm_head.weight"
"""The module key of a Hugging Face causal LM's output projection (transformers' ``_tied_weights_keys``)."""


def tied_head(family: Family, tied: bool | None = None) -> tuple[str, Tensor] | None:
    """The output projection a Hugging Face model holds besides its embedding when ``tied`` (by default: where the
    family always ties it), which Hugging Face never stores: (its module key, the embedding it is: the model's
    first registered parameter, ``get_input_embeddings()``). None for an untied model."""
    embed = tied_embedding(family, family.tied_default and not family.can_tie if tied is None else tied)
    return (TIED_HEAD, embed) if embed is not None else None


def deepspeed(family: Family, options: tuple[str, ...]) -> str:
    _only(options, ("hf-trainer", "zero3", *(["tied"] if family.can_tie else [])), family, "deepspeed")
    variant = _one_of(tuple(o for o in options if o != "tied"), ("hf-trainer", "zero3"), family, "deepspeed")
    tied = _flag(options, "tied", family)
    tensors = family.module_tensors(tied)

    def held(t: Tensor, name: str | None = None) -> str:  # as the model holds it: as Hugging Face stores it
        return f"{name or _layer_local(t.name)}{t.ref} = {t.hf_dims or t.dims}"

    lines = [family.logical_text(tied), "section model per tp pp"]
    if variant == "hf-trainer":
        lines += [held(t) for t in tensors if t.decay]
        lines += ["", "section nodecay per tp pp"]
        lines += [held(t) for t in tensors if not t.decay]
        flats = ["flat optimizer.0.{state} = model | pad 2*dp | split dp",
                 "flat optimizer.1.{state} = nodecay | pad 2*dp | split dp"]
    else:
        lines += [held(t) for t in tensors]
        flats = ["flat fp32_flat_groups.{state} = model | perparam | split dp" if variant == "zero3" else
                 "flat optimizer.{state} = model | pad 2*dp | split dp"]
    if buffers := _buffers(family):  # ZeRO-3: whole in every rank's model file
        lines += ["", f"section {BUFFERS} per tp pp" + " dp" * (variant == "zero3"), *(held(t) for t in buffers)]
    tie = tied_head(family, tied)
    if tie is not None and variant != "zero3":  # ZeRO-3 keeps a placeholder of it, no tensor
        lines += ["", "section module per tp pp", held(tie[1], tie[0])]
    lines += ["", f"section optim per tp pp dp {STATES}", *flats]
    return "\n".join(lines) + "\n"


def deepspeed_pipe(family: Family, options: tuple[str, ...]) -> str:
    _one_of(options, (), family, "deepspeed-pipe")
    if family.buffers:
        raise SpecError(f"deepspeed-pipe-{family.name}: no DeepSpeed pipeline layout for {family.name} (its "
                        f"persistent buffers {', '.join(family.buffers)} would be in the layer files' state dicts, "
                        "which the pipeline layout does not place buffers in yet; the deepspeed-"
                        f"{family.name} layouts hold them)")
    tensors = family.module_tensors(tied=False)
    layered = [t for t in tensors if "{i}" in t.name]
    first = tensors[:tensors.index(layered[0])]
    last = tensors[tensors.index(layered[-1]) + 1:]
    prefix = layered[0].name[:layered[0].name.index("{i}")]
    lines = [family.logical_text(tied=False), "section model per tp pp"]
    for k, t in enumerate(first):
        lines.append(f"{k}.{t.name.rsplit('.', 1)[-1]} @first{t.ref} = {t.dims}")
    for t in layered:
        local = t.name[len(prefix) + len("{i}."):]
        dims = _with(t.dims, t.tp, "/tp") if t.tp is not None else t.dims
        lines.append(f"{{i@pp+{len(first)}}}.{local}{t.ref} = {dims}")
    for k, t in enumerate(last):
        lines.append(f"{{=layers+{len(first) + k}}}.{t.name.rsplit('.', 1)[-1]} @last{t.ref} = {t.dims}")
    lines += ["", f"section optim per tp pp dp {STATES}", "flat optimizer.{state} = model | pad 2*dp | split dp"]
    return "\n".join(lines) + "\n"


# --- dcp ---------------------------------------------------------------------------------------------

TIED = "tied"
"""The section of a family's DCP layout that holds a tied output projection (``lm_head.weight``): the module's
state dict holds it beside the embedding it is (FSDP2's ``get_state_dict`` keeps both keys; the optimizer's state is
the embedding's alone), so that ``dcp.load`` of that state dict finds it."""


def _held(t: Tensor) -> tuple[str, int | None]:
    """A tensor as transformers' module holds it: its dims there (``hf_dims`` where set) and the one of them its
    tensor-parallel plan splits (the logical dim ``tp`` names, wherever the module holds it)."""
    if not t.hf_dims or t.tp is None:
        return t.hf_dims or t.dims, t.tp
    return t.hf_dims, _split_dims(t.hf_dims).index(_split_dims(t.dims)[t.tp])


def dcp(family: Family, options: tuple[str, ...]) -> str:
    _one_of(options, ("tied",) if family.can_tie else (), family, "dcp")
    tied = _flag(options, "tied", family)

    def rule(t: Tensor, dp: str, name: str | None = None) -> str:
        dims, split = _held(t)
        dims = _with(dims, split, "/tp") if split is not None else dims
        return f"model.{name or t.name}{t.ref} = {_with(dims, 0, dp) if dp else dims}"

    lines = [family.logical_text(tied), "section model per dp tp"]
    lines += [rule(t, "/dp:chunk") for t in family.module_tensors(tied)]
    if buffers := _buffers(family):  # FSDP2 shards parameters only: a buffer is whole on every rank, and no master
        lines += ["", f"section {BUFFERS} per dp tp", *(rule(t, "") for t in buffers)]
    if embed := tied_embedding(family, tied):
        lines += ["", f"section {TIED} per dp tp", rule(embed, "/dp:chunk", TIED_HEAD)]
    return "\n".join(lines) + "\n"


def tied_embedding(family: Family, tied: bool) -> Tensor | None:
    """The embedding a tied model's output projection is (its first registered parameter); None untied."""
    return family.by_registration(tied=True)[0] if tied and (family.can_tie or family.tied_default) else None


def module_text(family: Family, tied: bool) -> str:
    """transformers' module of the family as one unsharded layout: every tensor of its state dict whole under its
    name (``Family.module_tensors``, then its persistent buffers, then a tied output projection: the embedding under
    ``lm_head.weight``), as the module holds it. What a checkpoint of a module's state dict is seen through
    (``reshard.formats.module_view``)."""
    head = tied_embedding(family, tied)
    return "\n".join([family.logical_text(tied), "section model",
                      *(f"{t.name}{t.ref} = {t.hf_dims or t.dims}" for t in _state_dict(family, tied)),
                      *([f"{TIED_HEAD}{head.ref} = {head.hf_dims or head.dims}"] if head else [])]) + "\n"


def _state_dict(family: Family, tied: bool) -> list[Tensor]:
    """The tensors of the module's state dict: its parameters in registration order, then its persistent buffers."""
    return family.module_tensors(tied) + _buffers(family)


# --- megatron ----------------------------------------------------------------------------------------

def megatron(family: Family, options: tuple[str, ...]) -> str:
    tied = _flag(options, "tied", family)
    local = "local" in options
    ep = "ep" in options
    distopt = "distopt" in options
    torch_file = "torch" in options
    mtp = {"mtp": True} if "mtp" in options else {}  # multi-token-prediction layers (families with hf_layers)
    # How megatron-core stores the routed experts (reshard.models.moe_experts): SequentialMLP without an option.
    impl = {"experts": o for o in options if o in ("grouped", "tegrouped")}
    _only(options, ("tied", "local", "ep", "distopt", "torch", *(["mtp"] if "hf_layers" in family.sizes else []),
                    *(["grouped", "tegrouped", "etp"] if family.experts else [])), family, "megatron")
    if (ep or torch_file) and not distopt:
        raise SpecError(f"megatron-{family.name}-{'-'.join(options)}: -ep and -torch need -distopt")
    if "grouped" in options and "tegrouped" in options:
        raise SpecError(f"megatron-{family.name}-{'-'.join(options)}: -grouped and -tegrouped exclude each other")
    if "tegrouped" in options and distopt:
        raise SpecError(f"megatron-{family.name}-{'-'.join(options)}: no -distopt with -tegrouped: Transformer "
                        "Engine registers every local expert's fc1 before any fc2, and the spec language registers "
                        "expert by expert, so the optimizer's buffers would be misplaced")
    body = family.megatron(tied=tied, local=local, **mtp, **impl) if family.megatron else None
    if body is None:
        raise SpecError(f"{'-'.join(('megatron', family.name, *options))}: no Megatron layout for {family.name}"
                        f"{' tied' if tied else ''}{' in local layers' if local else ''}"
                        f"{''.join(f' with {v} experts' for v in impl.values())}{_why_not(family)}")
    if "etp" in options:
        body = _expert_tp(body)
    axes = "tp pp ep" if family.experts else "tp pp"
    lines = [family.logical_text(tied), f"section model per {axes}", body]
    model = "model"  # the params of the model section: its persistent buffers are in no optimizer
    for t in family.stored(tied):
        if t.alias in family.buffers and (glob := _megatron_name(body, t.alias)):
            model += f" | except {glob}"
    # The distributed optimizer's buffers: one of every param, or at ep > 1 the dense params' and the experts' (a
    # buffer of their own over the expert-data-parallel group); per dp rank, or coalesced as distrib_optim.pt.
    buffers = [("optim", "", " | except *.mlp.experts.*", "dp"), ("expert_optim", "expert_", " | only *.mlp.experts.*",
                                                                  "edp")] if ep else [("optim", "", "", "dp")]
    # megatron-core gives the embedding a bucket of its own at pp > 1 where a later stage holds a copy of it
    # (shared_embedding): tied, the last stage's output layer; with MTP, the last stage's embedding. Megatron's
    # resolution drops the ops at pp 1.
    shared = [*(["embedding.word_embeddings.weight"] if tied or mtp else []), *(["output_layer.weight"] if tied else [])]
    alone = "".join(f" | alone {name}" for name in shared)
    for k, (section, prefix, chosen, group) in enumerate(buffers if distopt else []):
        lines += [""] if k else []
        if torch_file:
            lines += [f"section {section} per {axes} {STATES}",
                      f"flat {prefix}distrib_optim.{{state}} = {model}{chosen} | {DISTOPT}{alone} | pad lcm("
                      f"{'dp * cp' if group == 'dp' else group}, 128) | coalesce"]
        else:
            lines += [f"section {section} per {axes} {group} {STATES}",
                      f"flat optimizer.distributed.{prefix}bucket_{{bucket}}.{{state}} = {model}{chosen} | "
                      f"{DISTOPT}{alone} | pad lcm({group}, 128) | split {group}"]
    return "\n".join(lines) + "\n"


def _expert_tp(body: str) -> str:
    """Megatron rules with the routed experts (``.mlp.experts.``) split over etp instead of tp (expert tensor
    parallelism, ``--expert-tensor-parallel-size``: whole experts at 1); shared experts and dense layers keep tp."""
    def split(rule: str) -> str:
        stored, eq, dims = rule.partition(" = ")
        if ".mlp.experts." not in stored:
            return rule
        return stored + eq + re.sub(r"\btp\b", "etp", dims)
    return "\n".join(split(rule) for rule in body.splitlines()) + ("\n" if body.endswith("\n") else "")


def _megatron_name(body: str, alias: str) -> str | None:
    """A glob of the stored names of the Megatron rule that stores ``alias`` (``*.mlp.router.expert_bias``); None
    where no rule does (a layer the option-less layout leaves out: MTP)."""
    rule = next((line for line in body.splitlines() if f"-> {alias} " in line), None)
    if rule is None:
        return None
    name = rule.split()[0]
    return "*" + name[name.rindex("}") + 1:] if "}" in name else name


def _why_not(family: Family) -> str:
    return f" ({family.plain_megatron})" if family.plain_megatron else ""


def megatron_legacy(family: Family, options: tuple[str, ...]) -> str:
    _one_of(options, ("tied",) if family.can_tie else (), family, "megatron-legacy")
    tied = _flag(options, "tied", family)
    body = family.megatron_legacy(tied) if family.megatron_legacy is not None else None
    if body is None:
        legacy = ", ".join(n for n in FAMILIES if get_family(n).megatron_legacy is not None)
        raise SpecError(f"megatron-legacy-{family.name}: no legacy Megatron-LM layout for {family.name}"
                        f"{' tied' if tied else ''}{_why_not(family)}: Megatron-LM's legacy model (--use-legacy-"
                        f"models) holds {legacy} only, its attention without a window or q/k norms"
                        + (f"; the megatron-core layout is megatron-{family.name}" if family.megatron else ""))
    return "\n".join([family.logical_text(tied), "section model per tp pp", body]) + "\n"


def torch_dist(family: Family, options: tuple[str, ...]) -> str:
    mtp = {"mtp": True} if "mtp" in options else {}  # multi-token-prediction layers (families with hf_layers)
    _only(options, ("tied", "local", *(["mtp"] if "hf_layers" in family.sizes else []),
                    *(["grouped"] if family.experts else [])), family, "mcore-dist")
    name = "-".join(("mcore-dist", family.name, *options))
    if not family.torch_dist or family.megatron is None:
        raise SpecError(f"{name}: no torch_dist layout for {family.name}{_why_not(family)}")
    if "tied" in options and not (family.can_tie or family.tied_default):
        raise SpecError(f"{name}: no torch_dist layout for {family.name} tied ({family.name} never ties its output "
                        "projection)")
    tied, local = _flag(options, "tied", family), "local" in options
    body = family.megatron(tied=tied, local=local, **mtp)
    # GroupedMLP saves SequentialMLP's keys and shapes (reshard.formats.megatron.dist_moe): the same rules
    grouped = "grouped" in options and family.megatron(tied=tied, local=local, experts="grouped", **mtp) is None
    if body is None or grouped:
        raise SpecError(f"{name}: no torch_dist layout for {family.name}{' in local layers' if local else ''}"
                        f"{' with grouped experts (GroupedMLP holds no biases)' if grouped else ''}{_why_not(family)}")
    per_layer = _SEVERAL_KINDS.search(body) is not None
    keys_map = local and "self_attention.linear_qkv." in body
    rules = [_whole(rule, name, keys_map, per_layer) for rule in body.splitlines()]
    return "\n".join([family.logical_text(tied), "section model", *filter(None, rules)]) + "\n"


_LOCAL_KEYS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
              ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
"""How megatron-core's local layers with fused-QKV attention key their norms in torch_dist (the local layer spec's
``sharded_state_dict_keys_map``): as Transformer Engine's fused ``layer_norm_weight`` of the next linear. In
dense layers that is Transformer Engine's own key; in MoE layers, whose pre-MLP norm Transformer Engine keeps as a
module of its own (``pre_mlp_layernorm.weight``), it is not. Its local MLA layers have no such map: their norms
keep their module names."""

_EXPERT = "experts.local_experts.{e/ep}."

_SEVERAL_KINDS = re.compile(r"decoder\.layers\.\{(?!i/)[a-z]\w*/pp\}\.")
"""A decoder layer of one kind among several (DeepSeek-V3's dense ``{d/pp}`` and MoE ``{m/pp}`` layers): megatron-core
keys such a model's layers per layer in torch_dist (``TransformerBlock.sharded_state_dict``: ``moe_layer_freq`` a
list makes the layers ``non_homogeneous_layers``)."""

_STAGE_LAYER = re.compile(r"\{([a-z]\w*)/pp\}\.")


def _whole(rule: str, name: str, keys_map: bool = False, per_layer: bool = False) -> str | None:
    """A Megatron rule as torch_dist stores its tensor: ``/tp`` splits dropped, the stage-local layer index turned
    into a leading dim (``{i}``), or with ``per_layer`` (layers of several kinds) into the global layer number in
    the key (``decoder.layers.{m}.``), a SequentialMLP's local expert number into the next leading dim (``{e}``:
    megatron-core keys every expert ``experts.experts.``, numbered globally), the padded vocabulary ``vpad`` rows,
    ``@first``/``@last`` dropped, with ``keys_map`` local layers' norms keyed as they key them (``_LOCAL_KEYS``);
    None for the tied output layer and the MTP stage's embedding copy, which torch_dist stores as the embedding's
    key."""
    target, dims = rule.split(" = ", 1)
    if "@lastonly" in target:
        return None
    target = re.sub(r" @(first|last)\b", "", target)
    dims = re.sub(r"~\([^()]*\)", "~vpad", re.sub(r"/tp\b", "", dims))
    lead = []
    layer = _STAGE_LAYER.search(target)
    if layer and per_layer:
        target = target.replace(layer.group(0), f"{{{layer.group(1)}}}.")
    elif layer and layer.group(1) == "i":
        target, lead = target.replace("{i/pp}.", ""), ["{i}"]
        if keys_map:
            for module, key in _LOCAL_KEYS:
                target = target.replace(f"decoder.layers.{module}", f"decoder.layers.{key}")
    if _EXPERT in target:
        target, lead = target.replace(_EXPERT, "experts.experts."), [*lead, "{e}"]
    if re.search(r"[{/](pp|ep|e)\b|@", f"{target} {dims}"):  # a placement this derivation does not know
        raise SpecError(f"{name}: the Megatron rule '{rule}' has no torch_dist form reshard derives")
    return f"{target} = {' '.join([*lead, dims])}"


FORMAT_RULES: dict[str, Callable[[Family, tuple[str, ...]], str]] = {
    # Longest prefix first: "megatron-legacy-llama" is not "megatron" with family "legacy".
    "megatron-legacy": megatron_legacy,
    "deepspeed-pipe": deepspeed_pipe,
    "mcore-dist": torch_dist,
    "megatron": megatron,
    "deepspeed": deepspeed,
    "hf": hf,
    "dcp": dcp,
}
"""Name prefix -> the rules that lay a family out in that format."""


def spec_text(name: str) -> str:
    """The text of the generated spec ``name`` (``<format>-<family>[-<option>...]``)."""
    for prefix, rules in FORMAT_RULES.items():
        if name.startswith(prefix + "-"):
            rest = name[len(prefix) + 1:].split("-")
            family = get_family(rest[0]) if rest[0] in FAMILIES else None
            if family is None:
                raise SpecError(f"no spec '{name}': '{rest[0]}' is not a model family (families: {', '.join(FAMILIES)})")
            return rules(family, _options(rest[1:]))
    raise SpecError(f"no spec '{name}' (a spec is <format>-<family>[-<option>...] with format one of "
                    f"{', '.join(FORMAT_RULES)} and family one of {', '.join(FAMILIES)}, or a path to a spec file)")


def layout_spec(name_or_path: str | Path) -> Spec:
    """The spec a format lays a checkpoint out with: generated by name, or a user's spec file by path (or a
    family's logical tensors by the family's name)."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith(".spec") or text in FAMILIES:
        return load_spec(name_or_path)
    return parse_spec(spec_text(text), source=f"<{text}>")


def spec_names() -> list[str]:
    """Every generated spec name the families and format rules give, without options."""
    return [f"{prefix}-{family}" for prefix in FORMAT_RULES for family in FAMILIES]


def _options(words: list[str]) -> tuple[str, ...]:
    out, k = [], 0
    while k < len(words):  # two-word options
        if words[k] == "hf" and k + 1 < len(words) and words[k + 1] == "trainer":
            out.append("hf-trainer")
            k += 2
            continue
        out.append(words[k])
        k += 1
    return tuple(out)


def _flag(options: tuple[str, ...], flag: str, family: Family) -> bool:
    if flag == "tied" and family.tied_default:
        return True
    if flag in options and not family.can_tie:
        raise SpecError(f"{family.name} cannot be {flag}")
    return flag in options


def _only(options: tuple[str, ...], allowed: tuple[str, ...], family: Family, prefix: str) -> None:
    bad = [o for o in options if o not in allowed]
    if bad:
        raise SpecError(f"{prefix}-{family.name}: unknown option {bad[0]!r} (options: {', '.join(allowed) or 'none'})")


def _one_of(options: tuple[str, ...], allowed: tuple[str, ...], family: Family, prefix: str) -> str | None:
    _only(options, allowed, family, prefix)
    if len(options) > 1:
        raise SpecError(f"{prefix}-{family.name}: at most one of {', '.join(allowed)}")
    return options[0] if options else None


def family_of(spec_name: str) -> Family | None:
    """The family a generated spec name lays out (``megatron-llama-tied`` -> llama); None for another spec."""
    for prefix in FORMAT_RULES:
        if spec_name.startswith(prefix + "-"):
            name = spec_name[len(prefix) + 1:].split("-")[0]
            return get_family(name) if name in FAMILIES else None
    return None


def source_family(source) -> Family | None:
    """The family of an opened checkpoint: the one its layout was generated from, or the one its carried
    ``config.json`` names; None when the checkpoint records neither (never guessed from tensor names:
    Llama and Mistral store the same names)."""
    family = family_of(source.spec_name)
    config = source.model.config
    if family is None and isinstance(config, dict):
        family = known_family(config)
    return family


def require_family(source, needs: str) -> Family:
    """The source's family, for a target that cannot be laid out without one (``needs`` says why:
    "Megatron stores each family's tensors its own way"); a CheckpointFormatError otherwise, naming the
    model the source records, if any. Never a guess: converting a model as another family changes it."""
    family = source_family(source)
    if family is not None:
        return family
    config = source.model.config
    if isinstance(config, dict):
        raise CheckpointFormatError(
            f"{source.path}: the model is model_type {config.get('model_type')!r} (its config.json), which no model "
            f"family reshard knows describes (known: {', '.join(FAMILIES)}); {needs}, and converting it as another "
            "family would change the model: give a spec, or convert to a format that keeps every tensor by name "
            "(hf, dcp, deepspeed)")
    raise CheckpointFormatError(
        f"{source.path}: which model this is is recorded nowhere (no config.json beside it, no model family in its "
        f"layout); {needs}: put the model's config.json beside the source, or give a spec")


def target_config(target, dtypes) -> dict | None:
    """The Hugging Face ``config.json`` a checkpoint written for ``target`` keeps beside its files (as the
    transformers Trainer leaves one, so the checkpoint names its own model): the one carried from the
    source, else one built from the target's family and sizes; None when neither is known."""
    family = get_family(target.model.family) if target.model.family in FAMILIES else None
    return _config(target.model, family, target.sizes, dtypes, tied=None)


def source_config(source, dtypes) -> dict | None:
    """The Hugging Face config of an opened checkpoint: carried with it, else built from its family and sizes
    (and hints, such as Megatron's args); None when neither is known. Formats that keep no model identity of
    their own (UCP, DCP) put it into their target so that it travels on."""
    family = source_family(source)
    tied = family.tied_in(source.layout.tensors) if family else None
    return _config(source.model, family, source.sizes, dtypes, tied=tied)


def _config(model, family: Family | None, sizes, dtypes, *, tied: bool | None) -> dict | None:
    if isinstance(model.config, dict):
        return model.config
    if family is None or not all(k in sizes for k in family.sizes):
        return None
    try:
        return hf_config(family, sizes, dtypes, hints=model.hints, tied=tied)
    except CheckpointFormatError:  # a mixture of experts whose routing nothing records
        return None
