"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm with bias, biases everywhere, a GELU MLP, and
the output projection tied to the embedding (never stored).

Sizes: ``h`` (``n_embd``), ``heads``, ``hd`` (``h / heads``), ``f`` (``n_inner``, 4h by default),
``vocab``, ``positions`` (``n_positions``), ``layers``. Logical tensors are in the ``[out, in]``
orientation; Hugging Face stores its Conv1D weights transposed, ``[in, out]``.

Megatron-core GPT in GPT-2 style stores q, k and v per head (``(heads/tp three hd)`` rows of
``linear_qkv``, against the logical ``(three heads hd)``), the position embedding on the first stage,
and the tied output layer as a copy of the embedding on the last stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama
from reshard.models.config import config_ints
from reshard.models.family import COLWISE, ROWWISE, Family, Tensor

__all__ = ["FAMILY", "config_from_sizes", "sizes_from_config"]

SIZES = ("h", "heads", "hd", "f", "vocab", "positions", "layers")


def _t(name: str, alias: str, dims: str, hf_dims: str | None = None, tp: int | None = None, decay: bool = True):
    return Tensor(name=f"transformer.{name}", alias=alias, dims=dims, hf_dims=hf_dims, tp=tp, decay=decay)


TENSORS = (
    _t("wte.weight", "wte", "vocab h"),
    _t("wpe.weight", "wpe", "positions h"),
    _t("h.{i}.ln_1.weight", "ln1", "h", decay=False),
    _t("h.{i}.ln_1.bias", "ln1_bias", "h", decay=False),
    _t("h.{i}.attn.c_attn.weight", "qkv", "(three heads hd) h", "h (three heads hd)", COLWISE),
    _t("h.{i}.attn.c_attn.bias", "qkv_bias", "(three heads hd)", tp=COLWISE, decay=False),
    _t("h.{i}.attn.c_proj.weight", "attn_out", "h (heads hd)", "(heads hd) h", ROWWISE),
    _t("h.{i}.attn.c_proj.bias", "attn_out_bias", "h", decay=False),
    _t("h.{i}.ln_2.weight", "ln2", "h", decay=False),
    _t("h.{i}.ln_2.bias", "ln2_bias", "h", decay=False),
    _t("h.{i}.mlp.c_fc.weight", "fc", "f h", "h f", COLWISE),
    _t("h.{i}.mlp.c_fc.bias", "fc_bias", "f", tp=COLWISE, decay=False),
    _t("h.{i}.mlp.c_proj.weight", "mlp_out", "h f", "f h", ROWWISE),
    _t("h.{i}.mlp.c_proj.bias", "mlp_out_bias", "h", decay=False),
    _t("ln_f.weight", "ln_f", "h", decay=False),
    _t("ln_f.bias", "ln_f_bias", "h", decay=False),
)

REGISTRATION = tuple(t.alias for t in TENSORS)

PREAMBLE = """\
let three = 3
index i < layers
"""

VOCAB = "(vocab~(vocab_div*tp))/tp h"


def megatron(*, tied: bool = True, local: bool = False) -> str | None:
    """Megatron-core GPT in GPT-2 style (``--position-embedding-type learned_absolute``, LayerNorm, biases): the
    norms fused into the next linear as Transformer Engine's ``layer_norm_weight``/``layer_norm_bias``, or with
    ``--transformer-impl local`` modules of their own (``input_layernorm``, ``pre_mlp_layernorm``), registered
    first in the layer."""
    if not tied:
        return None
    at = "decoder.layers.{i/pp}."
    ln1 = [f"{at}input_layernorm.weight -> ln1 = h", f"{at}input_layernorm.bias -> ln1_bias = h"] if local else \
        [f"{at}self_attention.linear_qkv.layer_norm_weight -> ln1 = h",
         f"{at}self_attention.linear_qkv.layer_norm_bias -> ln1_bias = h"]
    ln2 = [f"{at}pre_mlp_layernorm.weight -> ln2 = h", f"{at}pre_mlp_layernorm.bias -> ln2_bias = h"] if local else \
        [f"{at}mlp.linear_fc1.layer_norm_weight -> ln2 = h", f"{at}mlp.linear_fc1.layer_norm_bias -> ln2_bias = h"]
    proj = [f"{at}self_attention.linear_proj.weight -> attn_out = h (heads hd)/tp",
            f"{at}self_attention.linear_proj.bias -> attn_out_bias = h"]
    return "\n".join([
        f"embedding.word_embeddings.weight -> wte @first = {VOCAB}",
        "embedding.position_embeddings.weight -> wpe @first = positions h",
        *([*ln1, *proj] if local else [*proj, *ln1]),
        f"{at}self_attention.linear_qkv.weight -> qkv = (heads/tp three hd) h",
        f"{at}self_attention.linear_qkv.bias -> qkv_bias = (heads/tp three hd)",
        *ln2,
        f"{at}mlp.linear_fc1.weight -> fc = f/tp h",
        f"{at}mlp.linear_fc1.bias -> fc_bias = f/tp",
        f"{at}mlp.linear_fc2.weight -> mlp_out = h f/tp",
        f"{at}mlp.linear_fc2.bias -> mlp_out_bias = h",
        "decoder.final_layernorm.weight -> ln_f @last = h",
        "decoder.final_layernorm.bias -> ln_f_bias @last = h",
        f"output_layer.weight -> wte @lastonly = {VOCAB}",
    ]) + "\n"


def megatron_legacy(tied: bool = True) -> str | None:
    """Megatron-LM's legacy GPTModel in GPT-2 style (``--use-legacy-models``, learned absolute positions): the
    ``language_model`` tree, LayerNorms and linears with biases, q/k/v per head; the tied output layer is the
    embedding, a copy of which the last stage keeps (``word_embeddings_for_head``) when it is not the first."""
    if not tied:
        return None
    at = "language_model/encoder/layers.{i/pp}."
    return "\n".join([
        f"language_model/embedding/word_embeddings/weight -> wte @first = {VOCAB}",
        "language_model/embedding/position_embeddings/weight -> wpe @first = positions h",
        f"{at}input_norm.weight -> ln1 = h",
        f"{at}input_norm.bias -> ln1_bias = h",
        f"{at}self_attention.query_key_value.weight -> qkv = (heads/tp three hd) h",
        f"{at}self_attention.query_key_value.bias -> qkv_bias = (heads/tp three hd)",
        f"{at}self_attention.dense.weight -> attn_out = h (heads hd)/tp",
        f"{at}self_attention.dense.bias -> attn_out_bias = h",
        f"{at}post_attention_norm.weight -> ln2 = h",
        f"{at}post_attention_norm.bias -> ln2_bias = h",
        f"{at}mlp.dense_h_to_4h.weight -> fc = f/tp h",
        f"{at}mlp.dense_h_to_4h.bias -> fc_bias = f/tp",
        f"{at}mlp.dense_4h_to_h.weight -> mlp_out = h f/tp",
        f"{at}mlp.dense_4h_to_h.bias -> mlp_out_bias = h",
        "language_model/encoder/final_norm.weight -> ln_f @last = h",
        "language_model/encoder/final_norm.bias -> ln_f_bias @last = h",
        f"word_embeddings_for_head/weight -> wte @lastonly = {VOCAB}",
    ]) + "\n"


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """h, heads, hd, f, vocab, positions, layers from a ``GPT2Config`` dict."""
    keys = {"h": "n_embd", "heads": "n_head", "vocab": "vocab_size", "layers": "n_layer", "positions": "n_positions"}
    sizes = config_ints(config, keys, ("n_inner",), where)
    sizes["hd"] = sizes["h"] // sizes["heads"]
    sizes["f"] = int(config.get("n_inner") or 4 * sizes["h"])  # GPT2Config: n_inner None means 4 * n_embd
    return sizes


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """A minimal ``GPT2Config`` dict for model ``sizes``; other fields keep transformers' defaults."""
    missing = [k for k in SIZES if k not in sizes]
    if missing or sizes["heads"] * sizes["hd"] != sizes["h"]:
        raise CheckpointFormatError(f"cannot build a GPT-2 config.json from sizes {dict(sizes)}"
                                    + (f": {', '.join(missing)} unknown" if missing else ": heads * hd != h"))
    config: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": sizes["h"], "n_head": sizes["heads"],
        "n_inner": sizes["f"], "n_layer": sizes["layers"], "n_positions": sizes["positions"],
        "vocab_size": sizes["vocab"], "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }
    common = Counter(dtypes).most_common(1)
    if common:
        config["dtype"] = common[0][0]
    return config


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """The Megatron args of a GPT-2 of ``sizes``: learned absolute positions, LayerNorm, biases, GELU."""
    return {**llama.megatron_args(dict(sizes) | {"g": sizes["heads"]}, tied),
            "max_position_embeddings": int(sizes["positions"]), "position_embedding_type": "learned_absolute",
            "add_position_embedding": True, "use_rotary_position_embeddings": False,
            "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True, "add_qkv_bias": True,
            "group_query_attention": False, "num_query_groups": None, "layernorm_epsilon": 1e-5, "openai_gelu": True}


TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
"""``activation_function`` values that are the tanh approximation Megatron runs with ``--openai-gelu``
(``gelu`` is the exact one, Megatron's default)."""


def args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a ``GPT2Config`` (the source's, carried): its GELU and LayerNorm epsilon.

    Raises:
      CheckpointFormatError: naming a field Megatron's GPT cannot compute as transformers does (another
        activation, attention scaled by the inverse layer index or not scaled at all).
    """
    if not isinstance(config, Mapping):
        return {}
    act = config.get("activation_function", "gelu_new")
    if act not in (*TANH_GELU, "gelu"):
        raise CheckpointFormatError(f"activation_function = {act!r}: Megatron's GPT runs exact GELU or its tanh "
                                    "approximation only; converting would change the model")
    for key, default in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
        if bool(config.get(key, default)) != default:
            raise CheckpointFormatError(f"{key} = {config.get(key)!r}: Megatron scales attention by "
                                        "1/sqrt(head dim) only; converting would change the model")
    out: dict[str, Any] = {"openai_gelu": act in TANH_GELU}
    eps = config.get("layer_norm_epsilon")
    if isinstance(eps, int | float) and not isinstance(eps, bool):
        out.update(norm_epsilon=eps, layernorm_epsilon=eps)
    return out


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a ``GPT2Config`` takes from a Megatron run's args: the GELU and the LayerNorm epsilon (the inverse of
    ``args_from_config``)."""
    hints: dict[str, Any] = {"tie_word_embeddings": True,
                             "activation_function": "gelu_new" if args.get("openai_gelu") else "gelu"}
    eps = args.get("norm_epsilon", args.get("layernorm_epsilon"))
    if isinstance(eps, int | float) and not isinstance(eps, bool):
        hints["layer_norm_epsilon"] = eps
    return hints


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a GPT-2: LayerNorm, biases, learned absolute positions, no SwiGLU."""
    return (not args.get("swiglu", False) and args.get("normalization", "LayerNorm") == "LayerNorm"
            and bool(args.get("add_bias_linear", True)) and args.get("position_embedding_type") == "learned_absolute")


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    architectures=("GPT2LMHeadModel",),
    preamble=PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=SIZES,
    tied_default=True,
    can_tie=False,
    megatron=megatron,
    megatron_legacy=megatron_legacy,
    torch_dist=True,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=args_from_config,
)
