"""megatron-core runs the Megatron checkpoints reshard writes for each model family, on CPU.

Importable (no side effects) and runnable as a script: ``python tests/mcore_family_jobs.py CASE...``, where
each CASE directory holds ``meg/`` (a tp=1, pp=1 checkpoint in megatron-core's local layers, as reshard
writes it) and ``hf_logits.pt`` (``{"ids", "logits"}`` from transformers). For each case one process (world
size 1, gloo) builds a ``GPTModel`` from nothing but the args in the rank file, loads the rank file's model
state dict with strict key matching, runs the forward pass and writes ``mcore.json``: the keys missing and
unexpected, and the largest |difference| from transformers' logits over the real vocabulary.

CPU stand-ins, in this process only: ``torch.cuda.current_device`` is "cpu" (rotary embeddings move to it),
the CUDA RNG tracker's ``fork`` is a null context (attention dropout runs under it, at p=0 in eval mode),
experts skip Transformer Engine's gemm, the sliding-window mask is built on the CPU, and MLA knows Transformer
Engine is absent (its import of TE's names succeeds without it, as None). MLA's core attention is a CPU one
(``_cpu_core_attention``): megatron-core's local one refuses MLA's head sizes.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from jobs import exit_now


def _patch_cpu(torch) -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import moe_utils

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None

    def window_mask(sq, skv, window_size):  # megatron-core's get_sliding_window_causal_mask, on the CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = window_mask

    from megatron.core.transformer import multi_latent_attention
    multi_latent_attention.HAVE_TE = False  # its import of Transformer Engine's names succeeds without TE (as None)


def _model(args: dict, torch):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = args.get("num_experts")
    moe = {"num_moe_experts": experts, "moe_router_topk": args["moe_router_topk"],
           "moe_ffn_hidden_size": args["moe_ffn_hidden_size"],
           "moe_router_pre_softmax": bool(args.get("moe_router_pre_softmax")),
           "moe_token_dispatcher_type": "allgather", "moe_router_load_balancing_type": "none"} if experts else {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.utils import openai_gelu

    window = args.get("window_size")
    quick = bool(args.get("quick_geglu"))  # GPT-OSS: x * sigmoid(1.702 x), linear half offset, both clamped
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], gated_linear_unit=args["swiglu"] or quick,
        activation_func=quick_gelu if quick else F.silu if args["swiglu"] else openai_gelu if args.get("openai_gelu")
        else F.gelu, glu_linear_offset=args.get("glu_linear_offset", 0.0),
        activation_func_clamp_value=args.get("activation_func_clamp_value"),
        softmax_type=args.get("softmax_type", "vanilla"), window_attn_skip_freq=args.get("window_attn_skip_freq"),
        normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"],
        add_bias_linear=args["add_bias_linear"], add_qkv_bias=bool(args.get("add_qkv_bias")),
        qk_layernorm=bool(args.get("qk_layernorm")), window_size=tuple(window) if window else None,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, **moe)
    for key, value in args.items():  # yarn's fields are read off the config by GPTModel, not TransformerConfig's
        if key.startswith("yarn_"):
            setattr(config, key, value)
    if args.get("multi_latent_attention"):
        return _mla_model(args, config, torch)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                    qk_layernorm=bool(args.get("qk_layernorm")), normalization=args["normalization"])
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
                    max_sequence_length=args.get("max_position_embeddings") or 4096,
                    position_embedding_type=args["position_embedding_type"], rotary_base=args["rotary_base"],
                    rotary_percent=args.get("rotary_percent", 1.0), rope_scaling=bool(args.get("use_rope_scaling")),
                    rope_scaling_factor=args.get("rope_scaling_factor", 8.0),
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"])


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "mscale", "mscale_all_dim",
              "beta_fast", "beta_slow")
"""The MLA fields megatron-core reads off ``MLATransformerConfig`` (its own yarn rotary embedding included)."""

ROUTING_FIELDS = ("moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_router_score_function",
                  "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                  "moe_router_topk_scaling_factor", "moe_router_dtype")
"""DeepSeek-V3's MoE fields: shared experts, dense then MoE layers, sigmoid group-limited routing with the bias."""


def _mla_model(args: dict, plain, torch):
    """A DeepSeek-V3-style GPTModel: megatron-core's MLA layers and its dense/MoE layer pattern, from the args.

    megatron-core 0.16.1's local spec puts ``DotProductAttention`` under MLA, which refuses the ``k_channels`` /
    ``v_channels`` MLA passes (MLA runs on Transformer Engine's attention). Only that softmax(q k^T * scale) v
    is replaced here, by ``_CpuCoreAttention``: every MLA projection, norm, the rope split and yarn's scale stay
    megatron-core's, which is what the checkpoint's layout has to match."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(plain) if f.init}
    fields.update({k: args[k] for k in MLA_FIELDS + ROUTING_FIELDS if args.get(k) is not None})
    fields.update(multi_latent_attention=True, moe_layer_freq=list(fields["moe_layer_freq"]),
                  q_lora_rank=args.get("q_lora_rank"),  # None: queries without compression (linear_q_proj)
                  mtp_num_layers=args.get("mtp_num_layers"))  # the MTP block, built on the CPU core attention too
    config = MLATransformerConfig(**fields)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args["normalization"])
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _cpu_core_attention(torch)
    mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False) if config.mtp_num_layers else None
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=args["padded_vocab_size"],
                    mtp_block_spec=mtp,
                    max_sequence_length=args.get("max_position_embeddings") or 4096,
                    position_embedding_type=args["position_embedding_type"],
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"])


def _cpu_core_attention(torch):
    """Causal softmax(q k^T * scale) v for MLA's heads (q/k of ``k_channels``, v of ``v_channels``), [s, b, n, d]
    in, [s, b, n * v_channels] out, as megatron-core's core attention returns it."""
    from megatron.core.transformer.module import MegatronModule

    class _CpuCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                     k_channels=None, v_channels=None, **_):
            super().__init__(config=config)
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, **_):
            q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, n, s, d]
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            s = scores.shape[-1]
            scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1), float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)  # [b, n, s, dv]
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return _CpuCoreAttention


def _case(case: Path, torch) -> dict:
    (rank_file,) = (case / "meg").glob("iter_*/mp_rank_*/model_optim_rng.pt")
    saved = torch.load(rank_file, weights_only=False)  # the framework's own loader, as Megatron loads it
    args = vars(saved["args"])
    assert args.get("transformer_impl") == "local", args.get("transformer_impl")
    torch.manual_seed(0)
    model = _model(args, torch)
    try:
        model.load_state_dict(saved["model"], strict=True)
        missing = unexpected = []
    except RuntimeError as e:  # strict key matching failed: report both lists
        result = model.load_state_dict(saved["model"], strict=False)
        missing, unexpected = result.missing_keys, result.unexpected_keys
        if not (missing or unexpected):
            raise e
    reference = torch.load(case / "hf_logits.pt")
    ids = reference["ids"]
    s = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked
    positions = torch.arange(s).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, mask)[..., :args["vocab_size"]]
    diff = (logits.float() - reference["logits"].float()).abs().max().item()
    params = [name for name, _ in model.named_parameters()]  # registration order (the distributed optimizer's)
    stored = [k for k in saved["model"] if k in set(params)]
    return {"missing": missing, "unexpected": unexpected, "max_diff": diff, "in_registration_order": stored == params}


def main(cases: list[str]) -> None:
    import torch
    import torch.distributed as dist

    _patch_cpu(torch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)

    for case in map(Path, cases):
        (case / "mcore.json").write_text(json.dumps(_case(case, torch)))
    exit_now()


if __name__ == "__main__":
    main(sys.argv[1:])
