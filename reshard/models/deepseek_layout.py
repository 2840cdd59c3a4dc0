"""DeepSeek-V3's tensors and Megatron rules, with or without the queries' low-rank compression, and with the
multi-token-prediction (MTP) layers; the families themselves are ``reshard.models.deepseek_v3`` (``q_lora_rank``
set) and ``reshard.models.deepseek_v3_noqlora`` (``q_lora_rank`` null).

Layers: Hugging Face numbers the decoder layers ``0 .. layers-1`` and the MTP layers after them, ``layers ..
hf_layers-1`` (``hf_layers = num_hidden_layers + num_nextn_predict_layers``; the index ``t``). An MTP layer holds
``enorm`` (the next token's embedding), ``hnorm`` (the previous depth's hidden state), ``eh_proj`` ``[h, 2h]``
applied to [enorm(embedding); hnorm(hidden)], a whole decoder layer of the MoE kind under the same prefix, and
``shared_head.norm``. Official checkpoints also store ``embed_tokens`` and ``shared_head.head`` per MTP layer,
copies of the model's embedding and output projection that the layers share; no rule names them, so a Hugging
Face checkpoint keeps them as tensors of its own (``reshard.formats.hf``) and a layout that shares them (Megatron)
has no place for them: such a conversion is refused naming them.

Megatron-core (0.16) builds the MTP block on the last pipeline stage (its last virtual chunk):
``mtp.layers.{k}.enorm``, ``.hnorm``, ``.eh_proj`` (a column-parallel linear: split on its output over tp),
``.transformer_layer.*`` (the decoder layer, named as in ``decoder.layers``), ``.final_layernorm``, registered
after the decoder and before the output layer; that stage holds the embedding too (``embedding.word_embeddings``,
a copy of the first stage's, which the MTP layers embed the next tokens with), so the layout with MTP layers
(option ``mtp``) stores it there as well.
"""

from __future__ import annotations

from dataclasses import replace

from reshard.models import llama, moe_experts
from reshard.models.family import COLWISE, ROWWISE, Tensor

__all__ = ["layer_tensors", "megatron", "module_tensors", "mtp_tensors", "preamble", "registration"]

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{d}.mlp."
_MOE = "model.layers.{m}.mlp."
_MTP = "model.layers.{t}."
BUFFER_ALIASES = ("router_bias",)
"""The decoder layers' persistent buffers: the router's expert-choice bias (``e_score_correction_bias``)."""
MTP_PREFIX = "mtp_"
"""The aliases of an MTP layer's tensors: the decoder layer's with this prefix."""


def preamble() -> str:
    """The lets and indexes: decoder layers ``i`` (dense ``d``, MoE ``m``), MTP layers ``t``, experts ``e``."""
    return "\n".join([
        "let qhd = nope + rope", "let kvhd = nope + vd", "let kva = kvl + rope", "let fs = fe * shared",
        "let h2 = 2 * h", "index i < layers", "index d in i < dense", "index m in i from dense",
        "index n < hf_layers", "index t in n from layers", "index e < experts"]) + "\n"


def layer_tensors(q_lora: bool) -> tuple[Tensor, ...]:
    """The embedding, the decoder layers' tensors, the final norm and the output projection."""
    if q_lora:
        q = (Tensor(name=_ATTN + "q_a_proj.weight", alias="q_a", dims="ql h"),
             Tensor(name=_ATTN + "q_a_layernorm.weight", alias="q_a_norm", dims="ql", decay=False),
             Tensor(name=_ATTN + "q_b_proj.weight", alias="q_b", dims="(heads qhd) ql"))
    else:
        q = (Tensor(name=_ATTN + "q_proj.weight", alias="q", dims="(heads qhd) h"),)
    return (
        Tensor(name="model.embed_tokens.weight", alias="embed", dims="vocab h"),
        Tensor(name="model.layers.{i}.input_layernorm.weight", alias="ln1", dims="h", decay=False),
        *q,
        Tensor(name=_ATTN + "kv_a_proj_with_mqa.weight", alias="kv_a", dims="kva h"),
        Tensor(name=_ATTN + "kv_a_layernorm.weight", alias="kv_a_norm", dims="kvl", decay=False),
        Tensor(name=_ATTN + "kv_b_proj.weight", alias="kv_b", dims="(heads kvhd) kvl"),
        Tensor(name=_ATTN + "o_proj.weight", alias="o", dims="h (heads vd)"),
        Tensor(name="model.layers.{i}.post_attention_layernorm.weight", alias="ln2", dims="h", decay=False),
        Tensor(name=_MLP + "gate_proj.weight", alias="gate", dims="f h", tp=COLWISE),
        Tensor(name=_MLP + "up_proj.weight", alias="up", dims="f h", tp=COLWISE),
        Tensor(name=_MLP + "down_proj.weight", alias="down", dims="h f", tp=ROWWISE),
        Tensor(name=_MOE + "gate.weight", alias="router", dims="experts h"),
        Tensor(name=_MOE + "gate.e_score_correction_bias", alias="router_bias", dims="experts", decay=False),
        Tensor(name=_MOE + "experts.{e}.gate_proj.weight", alias="egate", dims="fe h", tp=COLWISE),
        Tensor(name=_MOE + "experts.{e}.up_proj.weight", alias="eup", dims="fe h", tp=COLWISE),
        Tensor(name=_MOE + "experts.{e}.down_proj.weight", alias="edown", dims="h fe", tp=ROWWISE),
        Tensor(name=_MOE + "shared_experts.gate_proj.weight", alias="sgate", dims="fs h", tp=COLWISE),
        Tensor(name=_MOE + "shared_experts.up_proj.weight", alias="sup", dims="fs h", tp=COLWISE),
        Tensor(name=_MOE + "shared_experts.down_proj.weight", alias="sdown", dims="h fs", tp=ROWWISE),
        Tensor(name="model.norm.weight", alias="norm", dims="h", decay=False),
        Tensor(name="lm_head.weight", alias="head", dims="vocab h"),  # never tied
    )


def mtp_tensors(q_lora: bool) -> tuple[Tensor, ...]:
    """The MTP layers' tensors: their own, and a decoder layer of the MoE kind (the layer's tensors renamed to
    ``{t}``, their aliases prefixed ``mtp_``)."""
    layer = [t for t in layer_tensors(q_lora) if "{i}" in t.name or "{m}" in t.name]
    inner = tuple(Tensor(name=t.name.replace("{i}", "{t}").replace("{m}", "{t}"), alias=MTP_PREFIX + t.alias,
                         dims=t.dims, tp=t.tp, decay=t.decay) for t in layer)
    return (
        Tensor(name=_MTP + "enorm.weight", alias="mtp_enorm", dims="h", decay=False),
        Tensor(name=_MTP + "hnorm.weight", alias="mtp_hnorm", dims="h", decay=False),
        Tensor(name=_MTP + "eh_proj.weight", alias="mtp_eh_proj", dims="h h2"),
        *inner,
        Tensor(name=_MTP + "shared_head.norm.weight", alias="mtp_norm", dims="h", decay=False),
    )


def registration(q_lora: bool) -> tuple[str, ...]:
    """``named_parameters()`` order: DeepseekV3DecoderLayer registers self_attn, mlp (dense: gate, up, down; MoE:
    experts, gate, shared_experts), then its norms; the router's ``e_score_correction_bias`` is a buffer. The MTP
    layers (no module of transformers') follow, in the order of megatron-core's."""
    q = ("q_a", "q_a_norm", "q_b") if q_lora else ("q",)
    attn = (*q, "kv_a", "kv_a_norm", "kv_b", "o")
    moe = ("egate", "eup", "edown", "router", "sgate", "sup", "sdown")
    mtp = ("mtp_enorm", "mtp_hnorm", "mtp_eh_proj", *(MTP_PREFIX + a for a in (*attn, *moe, "ln1", "ln2")),
           "mtp_norm")
    return ("embed", *attn, "gate", "up", "down", *moe, "ln1", "ln2", "norm", "head", *mtp)


def module_tensors(q_lora: bool) -> tuple[Tensor, ...]:
    """transformers 5's module in registration order: the embedding, the dense layers one by one, the MoE layers
    one by one (their routed experts fused: ``reshard.models.moe_experts.module_tensors``), the final norm, the
    output projection; then the MTP layers, which no module of transformers' holds, as the files name them. A
    layer's tensors are named by its kind's index (``{d}``, ``{m}``), so that each kind's rules make one block."""
    by = {t.alias: t for t in layer_tensors(q_lora) + mtp_tensors(q_lora)}
    fused = moe_experts.module_tensors(_MOE + "experts.", "fe", by["egate"], by["eup"], by["edown"])
    order = registration(q_lora)
    shared = [a for a in order if "{i}" in by[a].name]  # attention and norms: in every layer
    attn, norms = shared[:-2], shared[-2:]

    def block(kind: str, own: list[str]) -> list[Tensor]:
        out: list[Tensor] = []
        for a in (*attn, *own, *norms):
            t = by[a]
            out += fused if a == "egate" else [] if a in ("eup", "edown") else \
                [replace(t, name=t.name.replace("{i}", kind))]
        return out

    dense = block("{d}", [a for a in order if by[a].name.startswith(_MLP)])
    moe = block("{m}", [a for a in order if by[a].name.startswith(_MOE) and by[a].alias not in BUFFER_ALIASES])
    ends = [by[a] for a in order if "{" not in by[a].name]
    mtp = [by[a] for a in order if by[a].name.startswith(_MTP)]
    return (ends[0], *dense, *moe, *ends[1:], *mtp)


def _attention(at: str, a: str, *, q_lora: bool, local: bool) -> list[str]:
    """MLA's rules for one layer (aliases prefixed ``a``), in megatron-core's registration order: the input norm,
    Attention's ``linear_proj``, then MLASelfAttention's projections and, in local layers, its norms."""
    down = "/tp" if local else ""  # ColumnParallelLinear in local layers, TELinear (duplicated) in TE's
    sa = at + "self_attention."
    rules = [f"{at}input_layernorm.weight -> {a}ln1 = h", f"{sa}linear_proj.weight -> {a}o = h (heads vd)/tp"]
    if q_lora:
        rules.append(f"{sa}linear_q_down_proj.weight -> {a}q_a = ql{down} h")
        if not local:
            rules.append(f"{sa}linear_q_up_proj.layer_norm_weight -> {a}q_a_norm = ql")
        rules.append(f"{sa}linear_q_up_proj.weight -> {a}q_b = (heads/tp qhd) ql")
    else:  # a column-parallel linear in both layer kinds, without an input norm
        rules.append(f"{sa}linear_q_proj.weight -> {a}q = (heads/tp qhd) h")
    rules.append(f"{sa}linear_kv_down_proj.weight -> {a}kv_a = kva{down} h")
    if not local:
        rules.append(f"{sa}linear_kv_up_proj.layer_norm_weight -> {a}kv_a_norm = kvl")
    rules.append(f"{sa}linear_kv_up_proj.weight -> {a}kv_b = (heads/tp kvhd) kvl")
    if local:
        rules += [f"{sa}q_layernorm.weight -> {a}q_a_norm = ql"] if q_lora else []
        rules.append(f"{sa}kv_layernorm.weight -> {a}kv_a_norm = kvl")
    return rules


def _moe(at: str, a: str, experts: str) -> list[str]:
    """A MoE layer's MLP rules: the pre-MLP norm, the router and its expert bias, the routed experts over ep as
    ``experts`` stores them (``reshard.models.moe_experts``), the shared experts."""
    routed = moe_experts.expert_rules(f"{at}mlp.", "fe", (f"{a}egate", f"{a}eup", f"{a}edown"), impl=experts)
    return [f"{at}pre_mlp_layernorm.weight -> {a}ln2 = h",
            f"{at}mlp.router.weight -> {a}router = experts h",
            f"{at}mlp.router.expert_bias -> {a}router_bias = experts",
            *(routed or ()),
            f"{at}mlp.shared_experts.linear_fc1.weight = [{a}sgate: fs/tp | {a}sup: fs/tp] h",
            f"{at}mlp.shared_experts.linear_fc2.weight -> {a}sdown = h fs/tp"]


def _last(rule: str) -> str:
    """A rule placed on the last stage's last chunk, where megatron-core builds the MTP block."""
    name, rest = rule.split(" ", 1)
    return f"{name} @last {rest}"


def megatron(*, q_lora: bool, tied: bool = False, local: bool = False, mtp: bool = False,
             experts: str = "sequential") -> str | None:
    """Megatron-core GPT with MLA, dense layers then MoE layers (untied output layer), Transformer Engine's
    layers or ``--transformer-impl local``; with ``mtp``, the MTP block and the last stage's embedding copy
    (without it, a model with MTP layers has no place for them: a conversion to it is refused naming them)."""
    if tied or (local and experts == "tegrouped"):
        return None
    dense, moe = "decoder.layers.{d/pp}.", "decoder.layers.{m/pp}."
    ln2 = f"{dense}pre_mlp_layernorm.weight -> ln2 = h" if local else \
        f"{dense}mlp.linear_fc1.layer_norm_weight -> ln2 = h"
    rules = [f"embedding.word_embeddings.weight -> embed @first = {llama.VOCAB}"]
    if mtp:
        rules.append(f"embedding.word_embeddings.weight -> embed @lastonly = {llama.VOCAB}")
    rules += [
        *_attention(dense, "", q_lora=q_lora, local=local),
        ln2,
        f"{dense}mlp.linear_fc1.weight = [gate: f/tp | up: f/tp] h",
        f"{dense}mlp.linear_fc2.weight -> down = h f/tp",
        *_attention(moe, "", q_lora=q_lora, local=local),
        *_moe(moe, "", experts),
        "decoder.final_layernorm.weight -> norm @last = h"]
    at = "mtp.layers.{t+0-layers}."  # megatron-core numbers its MTP layers from 0
    layer = at + "transformer_layer."
    rules += [] if not mtp else [_last(r) for r in [
        f"{at}enorm.weight -> mtp_enorm = h", f"{at}hnorm.weight -> mtp_hnorm = h",
        f"{at}eh_proj.weight -> mtp_eh_proj = h/tp h2",
        *_attention(layer, MTP_PREFIX, q_lora=q_lora, local=local), *_moe(layer, MTP_PREFIX, experts),
        f"{at}final_layernorm.weight -> mtp_norm = h"]]
    rules.append(f"output_layer.weight -> head @last = {llama.VOCAB}")
    return "\n".join(rules) + "\n"
