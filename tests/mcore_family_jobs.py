"""megatron-core runs the Megatron checkpoints reshard writes for each model family, on CPU.

Importable (no side effects) and runnable as a script: ``python tests/mcore_family_jobs.py CASE...``, where
each CASE directory holds ``meg/`` (a tp=1, pp=1 checkpoint in megatron-core's local layers, as reshard
writes it) and ``hf_logits.pt`` (``{"ids", "logits"}`` from transformers). For each case one process (world
size 1, gloo) builds a ``GPTModel`` from nothing but the args in the rank file, loads the rank file's model
state dict with strict key matching, runs the forward pass and writes ``mcore.json``: the keys missing and
unexpected, and the largest |difference| from transformers' logits over the real vocabulary.

CPU stand-ins, in this process only: ``torch.cuda.current_device`` is "cpu" (rotary embeddings move to it),
the CUDA RNG tracker's ``fork`` is a null context (attention dropout runs under it, at p=0 in eval mode),
experts skip Transformer Engine's gemm, and the sliding-window mask is built on the CPU.
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

    window = args.get("window_size")
    quick = bool(args.get("quick_geglu"))  # GPT-OSS: x * sigmoid(1.702 x), linear half offset, both clamped
    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], gated_linear_unit=args["swiglu"] or quick,
        activation_func=quick_gelu if quick else F.silu, glu_linear_offset=args.get("glu_linear_offset", 0.0),
        activation_func_clamp_value=args.get("activation_func_clamp_value"),
        softmax_type=args.get("softmax_type", "vanilla"), window_attn_skip_freq=args.get("window_attn_skip_freq"),
        normalization=args["normalization"], layernorm_epsilon=args["norm_epsilon"],
        add_bias_linear=args["add_bias_linear"], add_qkv_bias=bool(args.get("add_qkv_bias")),
        qk_layernorm=bool(args.get("qk_layernorm")), window_size=tuple(window) if window else None,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, **moe)
    for key, value in args.items():  # yarn's fields are read off the config by GPTModel, not TransformerConfig's
        if key.startswith("yarn_"):
            setattr(config, key, value)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                    qk_layernorm=bool(args.get("qk_layernorm")), normalization=args["normalization"])
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
                    max_sequence_length=args.get("max_position_embeddings") or 4096,
                    position_embedding_type=args["position_embedding_type"], rotary_base=args["rotary_base"],
                    rotary_percent=args.get("rotary_percent", 1.0), rope_scaling=bool(args.get("use_rope_scaling")),
                    rope_scaling_factor=args.get("rope_scaling_factor", 8.0),
                    share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"])


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
