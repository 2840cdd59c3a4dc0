"""Megatron's ``args``: what a checkpoint's args say, and the args a target is written with.

Reading: the parallel layout, the pipeline's uneven or virtual stages and the model sizes
a checkpoint's ``args`` record, and its DDP bucket size. Writing: ``megatron_args``
updates a source's args for a new topology or synthesizes a minimal
set from the model family's own args (``reshard.models``: the architecture, and what a Hugging
Face ``config.json`` shares with them) and a fresh run's.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from reshard.core.topology import Topology, parse_topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.formats.base import MAX_COUNT, MAX_SIZE, expect_int, given_sizes
from reshard.io.torchfile import TorchDtype
from reshard.models import family_for_megatron_args, get_family

DEFAULT_SEED = 1234  # Megatron's --seed default


def _namespace(obj: Any, where: str) -> dict[str, Any]:
    """The attributes of a pickled ``argparse.Namespace`` as a dict."""
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    raise CheckpointFormatError(f"{where}: 'args' is {type(obj).__name__}, expected an argparse.Namespace")


def _arg(args: Mapping[str, Any], name: str, where: str) -> Any:
    value = args.get(name)
    if value is None:
        raise CheckpointFormatError(f"{where}: args.{name} is missing")
    return value


def _int_arg(args: Mapping[str, Any], name: str, where: str, default: int | None = None, *, lo: int = 1,
             hi: int = MAX_COUNT) -> int:
    """``args.<name>``, an integer in ``[lo, hi]`` (``default`` when missing or None; required without one)."""
    value = args.get(name)
    if value is None and default is not None:
        return default
    return expect_int(_arg(args, name, where), f"args.{name}", where, lo=lo, hi=hi)


def _topology_from_args(args: Mapping[str, Any], where: str, ranks: int) -> Topology:
    """The parallel layout ``args`` record, whose model-parallel ranks (tp * pp * ep) must fit in the ``ranks``
    rank directories found."""
    tp = _int_arg(args, "tensor_model_parallel_size", where, hi=max(1, ranks))
    pp = _int_arg(args, "pipeline_model_parallel_size", where, hi=max(1, ranks))
    cp = _int_arg(args, "context_parallel_size", where, 1)
    ep = _int_arg(args, "expert_model_parallel_size", where, 1, hi=max(1, ranks))
    etp = None if args.get("expert_tensor_parallel_size") is None else \
        _int_arg(args, "expert_tensor_parallel_size", where)
    etp = None if not args.get("num_experts") or etp == tp else etp  # None: the experts split over tp
    if (etp or tp) * pp * ep > max(1, ranks) or tp * pp > max(1, ranks):
        shown = f"tp({tp}) * pp({pp}) * ep({ep}) = {tp * pp * ep}" if etp is None else \
            f"pp({pp}) * ep({ep}) = {pp * ep} (expert_tensor_parallel_size={etp})"
        raise CheckpointFormatError(f"{where}: args say {shown} rank directories, the checkpoint has {ranks}")
    if ep > 1 and not args.get("num_experts"):
        raise CheckpointFormatError(f"{where}: expert_model_parallel_size={ep} without num_experts")
    if cp > 1:
        raise CheckpointFormatError(f"{where}: context_parallel_size={cp} is not supported yet")
    world = _int_arg(args, "world_size", where, 0, lo=0, hi=MAX_COUNT * ranks)
    dp = _int_arg(args, "data_parallel_size", where, world // (tp * pp * cp) or 1)
    if world and world != tp * pp * cp * dp:
        raise CheckpointFormatError(f"{where}: tp({tp}) * pp({pp}) * dp({dp}) = {tp * pp * dp} != world_size({world})")
    layers = _int_arg(args, "num_layers", where)
    if etp is None and (dp * cp) % ep:
        raise CheckpointFormatError(f"{where}: expert_model_parallel_size={ep} does not divide data_parallel_size={dp}")
    if etp is not None and (tp * dp * cp) % (etp * ep):
        raise CheckpointFormatError(
            f"{where}: expert_tensor_parallel_size({etp}) * expert_model_parallel_size({ep}) = {etp * ep} does "
            f"not divide tp({tp}) * dp({dp}) * cp({cp}) = {tp * dp * cp}")
    try:
        vpp, stages = _pipeline_from_args(args, pp, layers, where)
        return Topology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, stages=stages)
    except TopologyError as e:
        raise CheckpointFormatError(f"{where}: args give no valid pipeline: {e}") from None


def _pipeline_from_args(args: Mapping[str, Any], pp: int, layers: int,
                        where: str) -> tuple[int, tuple[int, ...] | None]:
    """vpp and layers per virtual stage (None: even), as Megatron's get_num_layers_to_build places them."""
    if args.get("account_for_embedding_in_pipeline_split") or args.get("account_for_loss_in_pipeline_split"):
        raise CheckpointFormatError(f"{where}: --account-for-embedding/loss-in-pipeline-split is not supported yet")
    vpp = _int_arg(args, "virtual_pipeline_model_parallel_size", where, 1, hi=layers)
    layout = args.get("pipeline_model_parallel_layout")
    if layout is not None:
        if not isinstance(layout, str):
            raise CheckpointFormatError(
                f"{where}: args.pipeline_model_parallel_layout is a {type(layout).__name__}, expected a string")
        topo = parse_topology(f"pp={pp},layout={layout}")
        return topo.vpp, topo.stages
    first, last = (None if args.get(k) is None else _int_arg(args, k, where, lo=0, hi=layers)
                   for k in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"))
    if first is None and last is None:
        return vpp, None
    rest, left = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if left > 0 and rest % left:
        raise CheckpointFormatError(f"{where}: {rest} layers left over for {left} middle stages do not divide evenly")
    per_stage = [rest // left if left > 0 else 0] * pp
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    if any(n % vpp for n in per_stage):
        raise CheckpointFormatError(f"{where}: stage layer counts {per_stage} are not divisible by vpp({vpp})")
    return vpp, tuple(per_stage[v % pp] // vpp for v in range(pp * vpp))


def _sizes_from_args(args: Mapping[str, Any], given: Mapping[str, int], topo: Topology, where: str) -> dict[str, int]:
    def arg(name: str, default: int | None = None) -> int:
        return _int_arg(args, name, where, default, hi=MAX_SIZE)

    h, heads = arg("hidden_size"), arg("num_attention_heads")
    g = arg("num_query_groups", heads) if args.get("group_query_attention") else heads
    sizes = {
        "h": h, "heads": heads, "g": g, "hd": arg("kv_channels", h // heads),
        "f": arg("moe_ffn_hidden_size") if args.get("moe_ffn_hidden_size") else arg("ffn_hidden_size"),
        "layers": _int_arg(args, "num_layers", where), "vocab_div": arg("make_vocab_size_divisible_by", 128),
    }
    if args.get("num_experts"):
        sizes["experts"] = _int_arg(args, "num_experts", where)
    family = family_for_megatron_args(args)
    if family is not None and family.sizes_from_args is not None:  # sizes Llama's args do not have (MLA's)
        sizes.update(family.sizes_from_args(args, arg))
    if get_family("gpt2").is_megatron(args):
        if sizes["g"] != heads:
            raise CheckpointFormatError(f"{where}: num_query_groups={sizes['g']} with num_attention_heads={heads}; "
                                        "GPT-2-style specs have one key/value head per query head")
        sizes["positions"] = arg("max_position_embeddings")
        del sizes["g"]
    padded = None if args.get("padded_vocab_size") is None else arg("padded_vocab_size")
    given = given_sizes(given)
    vocab = given.get("vocab", None if args.get("vocab_size") is None else arg("vocab_size"))
    if vocab is None:
        hint = f" (a number in [{padded - sizes['vocab_div'] * topo.tp + 1}, {padded}])" if padded else ""
        raise CheckpointFormatError(
            f"{where}: args has padded_vocab_size={padded} but not the tokenizer's vocab size; "
            f"give it as sizes={{'vocab': N}}{hint}")
    sizes["vocab"] = vocab
    sizes.update(given)
    if padded is not None:
        want = _padded_vocab(sizes["vocab"], sizes["vocab_div"], topo.tp)
        if want != padded:
            raise CheckpointFormatError(
                f"{where}: vocab {sizes['vocab']} pads to {want} at tp={topo.tp} "
                f"(make_vocab_size_divisible_by={sizes['vocab_div']}), but args.padded_vocab_size is {padded}")
    return sizes


def _padded_vocab(vocab: int, div: int, tp: int) -> int:
    multiple = div * tp
    return -(-vocab // multiple) * multiple


def _bucket_size(args: Mapping[str, Any], topo: Topology) -> int:
    """The DDP bucket size of (pp rank 0, chunk 0), 0 for one bucket (training.py :: resolve_ddp_bucket_size)."""
    if not args.get("overlap_grad_reduce"):
        return 0
    if args.get("ddp_num_buckets"):
        raise CheckpointFormatError(
            "--ddp-num-buckets is not supported yet (its bucket size depends on the model's parameter count)")
    if args.get("ddp_bucket_size"):
        return _int_arg(args, "ddp_bucket_size", "args", hi=MAX_SIZE)
    return max(40_000_000, 1_000_000 * topo.dp * topo.cp)


def megatron_args(sizes: Mapping[str, int], topology: Topology, *, base: Mapping[str, Any] | None = None,
                  tied: bool = False, iteration: int = 0, family: str = "llama") -> dict[str, Any]:
    """Megatron's ``args`` (as a dict) for a checkpoint of the model ``sizes`` at ``topology``.

    ``base`` (a source checkpoint's args) is kept and only its parallel layout is
    updated: tensor/pipeline/expert sizes, the virtual pipeline and uneven stages,
    ``data_parallel_size``, ``world_size``, ``padded_vocab_size`` (recomputed for the
    new tp, as ``vocab_size_with_padding`` does) and ``use_distributed_optimizer``.
    Without ``base``, a minimal set is synthesized: the model ``family``'s own args
    (``reshard.models``) and a fresh run's: what
    ``load_args_from_checkpoint`` and ``check_checkpoint_args`` read, and what ``open``
    needs (``vocab_size`` included, so the real vocab is never lost).
    """
    if base:
        a = dict(base)
    else:
        model = get_family(family)
        if model.megatron_args is None:
            raise CheckpointFormatError(f"Megatron has no args for the {family} family")
        a = {**model.megatron_args(sizes, tied), **_run_args(sizes, iteration)}
    tp, pp, dp, cp = topology.tp, topology.pp, topology.dp, topology.cp
    div = int(a.get("make_vocab_size_divisible_by") or sizes.get("vocab_div", 128))
    a.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        data_parallel_size=dp,
        world_size=tp * pp * dp * cp,
        padded_vocab_size=_padded_vocab(int(sizes["vocab"]), div, tp),
        use_distributed_optimizer=topology.zero == 1,
    )
    a.setdefault("vocab_size", int(sizes["vocab"]))
    if "transformer_pipeline_model_parallel_size" in a:
        a["transformer_pipeline_model_parallel_size"] = pp
    if topology.etp is not None:
        a["expert_tensor_parallel_size"] = topology.etp
    elif a.get("expert_tensor_parallel_size") is not None:  # the target lays its experts out at etp = tp
        a["expert_tensor_parallel_size"] = tp
    if "expert_model_parallel_size" in a or topology.ep > 1:
        a["expert_model_parallel_size"] = topology.ep
    a.update(_pipeline_args(topology, int(sizes["layers"])))
    return a


def _run_args(sizes: Mapping[str, int], iteration: int) -> dict[str, Any]:
    """The args of a fresh run that are not the model's: precision, DDP, seed, optimizer, schedule, checkpointing."""
    return {
        "bf16": True, "fp16": False, "params_dtype": TorchDtype("bfloat16"), "accumulate_allreduce_grads_in_fp32": True,
        "overlap_grad_reduce": False, "ddp_bucket_size": None, "ddp_num_buckets": None,
        "seed": DEFAULT_SEED, "data_parallel_random_init": False,
        "optimizer": "adam", "lr": 3.0e-4, "min_lr": 3.0e-5, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95,
        "adam_eps": 1e-8, "clip_grad": 1.0, "lr_decay_style": "cosine", "lr_warmup_iters": 0,
        "train_iters": max(iteration, 1), "global_batch_size": 1, "micro_batch_size": 1,
        "ckpt_format": "torch", "use_dist_ckpt": False, "no_save_optim": None, "no_save_rng": None,
        "iteration": iteration, "consumed_train_samples": iteration, "consumed_valid_samples": 0,
        "skipped_train_samples": 0,
    }


def _pipeline_args(topology: Topology, layers: int) -> dict[str, Any]:
    """The virtual-pipeline and uneven-stage args that make Megatron place layers as ``topology`` does."""
    pp, vpp = topology.pp, topology.vpp
    topology.layer_placement(layers)  # validates stages against the layer count
    out: dict[str, Any] = {
        "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
        "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
        "pipeline_model_parallel_layout": None,
    }
    stages = topology.stages
    if stages is None or len(set(stages)) == 1:
        if vpp > 1:
            out["num_layers_per_virtual_pipeline_stage"] = layers // (pp * vpp)
        return out
    per_stage = [sum(stages[v] for v in range(s, pp * vpp, pp)) for s in range(pp)]
    chunk_even = all(stages[v] * vpp == per_stage[v % pp] for v in range(pp * vpp))
    if chunk_even and pp >= 2 and len(set(per_stage[1:-1])) <= 1:
        out["decoder_first_pipeline_num_layers"] = per_stage[0]
        out["decoder_last_pipeline_num_layers"] = per_stage[-1]
        if vpp > 1:
            out["num_virtual_stages_per_pipeline_rank"] = vpp
        return out
    # Anything else: an explicit --pipeline-model-parallel-layout, one '|' per virtual stage.
    parts = ["t" * n for n in stages]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    out["pipeline_model_parallel_layout"] = "|".join(parts)
    return out
