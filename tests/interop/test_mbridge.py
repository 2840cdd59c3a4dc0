"""Hugging Face -> Megatron, judged by an independent converter: mbridge's own mapping gives the same tensors.

For every model family both reshard (``reshard.models.FAMILIES``, with a Megatron layout) and mbridge
(``AutoBridge.list_supported_models()``) know, a tiny random bf16 model saved by transformers goes to
Megatron with ``reshard.convert``; its rank files, read with reshard's own torch-file reader, must hold
exactly the tensors mbridge's ``_weight_to_mcore_format`` builds from the same Hugging Face weights (the
q/k/v interleave by query group, the gate/up fusion), bit for bit. At tp=2 mbridge's
``_weight_split_across_tp`` splits them, and each rank file must hold its part. The bridges are made from
the Hugging Face config with the parallel sizes alone (no process group, no model); a bridge whose
constructor fails with the pinned frameworks (``NO_MCORE_CONFIG``, with the reason) is made without its
megatron-core config, which its HF -> Megatron mapping does not read.

The names agree too: mbridge maps every name reshard wrote to Hugging Face names
(``_weight_name_mapping_mcore_to_hf``, which refuses a name it does not know), and those cover each tensor of
the Hugging Face checkpoint exactly once. mbridge takes its own name set from a built GPTModel, which needs
Transformer Engine, so the test checks the mapping instead of building one.

Two differences are conventions, not values, and are bridged here:
- Experts: reshard writes megatron-core's SequentialMLP (``mlp.experts.local_experts.{e}.linear_fc1.weight``),
  mbridge the grouped-GEMM TEGroupedMLP (``mlp.experts.linear_fc1.weight{e}``); expert e's matrix is the
  same in both, so reshard's names are renamed before mbridge maps them.
- Vocabulary padding: Megatron pads the vocabulary to a multiple of 128 * tp (reshard's default, with zero
  rows); mbridge pads to a multiple of ``make_vocab_size_divisible_by`` (also with zero rows), which is given
  128 * tp here. Its model provider sets the padded size; the test sets it the same way, so the whole padded
  tensors are compared, padding rows included.
Names that are not parameters (``_extra_state``) are left out on both sides.

DeepSeek-V3's MTP layer is checked too: ``mtp.layers.0.*`` from HF ``model.layers.61.*``, at 61 layers as mbridge needs.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import require

import reshard
from reshard.io.torchfile import TensorRef, read_torch_file
from reshard.models import FAMILIES, get_family

VOCAB = 1000  # not a multiple of 128: both pad it to 1024
CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
          "vocab_size": VOCAB, "num_hidden_layers": 2, "tie_word_embeddings": False}
SMALL = {  # set where the family's config has the field
    "head_dim": 32,  # not hidden / heads, so kv_channels matters
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "num_nextn_predict_layers": 0,
}
# mbridge bridges whose constructor fails with the pinned frameworks, and why. The HF -> Megatron mapping reads
# only the Hugging Face config, the dtype, the parallel sizes and three fields of the megatron-core config
# (``gated_linear_unit``; ``num_layers`` and ``mtp_num_layers`` for DeepSeek-V3's MTP names), so for these the
# test makes the bridge without its megatron-core config (and checks that the constructor still fails).
NO_MCORE_CONFIG = {
    "deepseek_v3": "mbridge 0.15.1's DeepseekV3Bridge._build_config reads hf_config.rope_theta (transformers 5 "
                   "keeps it in rope_parameters) and passes max_position_embeddings to megatron-core 0.16's "
                   "MLATransformerConfig, which has no such field",
}
EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
MTP_LAYER = 61  # mbridge 0.15.1's DeepSeek-V3 bridge maps one MTP layer, Hugging Face layer 61, after 61 layers


def _mbridge():
    """mbridge's AutoBridge, imported quietly (megatron-core warns about missing Transformer Engine and Apex)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return require("mbridge").AutoBridge


def _bridge(auto_bridge, config, tp: int):
    """mbridge's bridge for ``config`` at tp (and expert tp), with no process groups: only the sizes are read."""
    import torch
    from mbridge.core.bridge import _MODEL_REGISTRY
    from mbridge.core.parallel_states import ParallelStates

    kwargs = {"dtype": torch.bfloat16, "parallel_states": ParallelStates(tp_size=tp, etp_size=tp),
              "make_vocab_size_divisible_by": 128 * tp}
    with warnings.catch_warnings():  # megatron-core's TransformerConfig warns about CUDA-graph defaults
        warnings.simplefilter("ignore")
        if config.model_type not in NO_MCORE_CONFIG:
            bridge = auto_bridge.from_config(config, **kwargs)
        else:
            with pytest.raises((AttributeError, TypeError)):
                auto_bridge.from_config(config, **kwargs)
            cls = _MODEL_REGISTRY[config.model_type]
            bridge = cls.__new__(cls)  # Bridge.__init__ without _build_config
            bridge.hf_config, bridge.extra_args, bridge.dtype, bridge.mpu = config, {}, kwargs["dtype"], \
                kwargs["parallel_states"]
            bridge.make_vocab_size_divisible_by = kwargs["make_vocab_size_divisible_by"]
            # as mbridge's _build_config sets them: num_layers from num_hidden_layers (LLMBridge's
            # _build_base_config), mtp_num_layers from num_nextn_predict_layers (DeepseekV3Bridge._build_config)
            bridge.config = SimpleNamespace(gated_linear_unit=True, num_layers=config.num_hidden_layers,
                                            mtp_num_layers=getattr(config, "num_nextn_predict_layers", None))
            bridge._adjust_mapping_for_shared_weights()
    bridge.vocab_size = config.vocab_size  # as mbridge's model provider sets them
    bridge.padded_vocab_size = math.ceil(config.vocab_size / (128 * tp)) * 128 * tp
    return bridge


def _shared_families(auto_bridge) -> list[str]:
    known = set(auto_bridge.list_supported_models())
    return [n for n in FAMILIES if get_family(n).megatron is not None and n in known]


def _save_tiny(name: str, path: Path, **overrides):
    """The family's tiny random model in bf16, every tensor random (norms too); its config. ``overrides`` are set on
    the config after ``CONFIG`` and ``SMALL``."""
    import torch
    transformers = require("transformers")
    config = transformers.AutoConfig.for_model(name, **CONFIG)
    for key, value in SMALL.items():
        if hasattr(config, key):
            setattr(config, key, value)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    model.save_pretrained(path)
    return config


def _tensor(ref: TensorRef):
    """The values of a tensor reshard wrote, from its bytes in the rank file."""
    import torch

    assert ref.is_contiguous, ref
    raw = np.fromfile(ref.path, dtype=np.uint8, count=ref.nbytes, offset=ref.data_offset)
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, ref.dtype)).reshape(ref.shape)


def _mbridge_name(name: str) -> str:
    """reshard's SequentialMLP expert name as mbridge's grouped-GEMM name; any other name unchanged."""
    m = EXPERT.match(name)
    return f"{m[1]}.{m[3]}{m[2]}" if m else name


def _rank_files(out: Path, tp: int) -> tuple[dict, list[dict]]:
    """The Megatron args and each tp rank's model (its parameters: no ``_extra_state``) reshard wrote at pp=1."""
    files = sorted(out.rglob("model_optim_rng.pt"))
    assert [f.parent.name for f in files] == [f"mp_rank_{r:02d}" for r in range(tp)], files
    ranks = [read_torch_file(f) for f in files]
    args = ranks[0]["args"] if isinstance(ranks[0]["args"], dict) else vars(ranks[0]["args"])
    models = [{k: v for k, v in rank["model"].items() if "_extra_state" not in k} for rank in ranks]
    assert all(m.keys() == models[0].keys() for m in models)
    return args, models


def _compare(bridge, hf: dict, models: list[dict], keys: list[str], want: list[str]) -> list[str]:
    """What differs between reshard's tensors ``keys`` on each tp rank and what mbridge builds for them from the
    Hugging Face tensors ``hf``; and whether mbridge maps ``keys`` to the Hugging Face names ``want``, each once."""
    import torch

    tp = len(models)
    problems, used = [], []
    for key in keys:
        mb_key = _mbridge_name(key)
        hf_names = bridge._weight_name_mapping_mcore_to_hf(mb_key)
        used += hf_names
        full = bridge._weight_to_mcore_format(mb_key, [hf[n] for n in hf_names])
        # mbridge takes the split dim of a plain tensor from the local parameter's shape (given as an empty one)
        parts = bridge._weight_split_across_tp(mb_key, full, torch.empty(models[0][key].shape), tp)
        for rank, (model, part) in enumerate(zip(models, parts, strict=True)):
            got = _tensor(model[key])
            if got.dtype != part.dtype or got.shape != part.shape:
                problems.append(f"{key} (tp rank {rank}): reshard {got.dtype} {tuple(got.shape)}, "
                                f"mbridge {part.dtype} {tuple(part.shape)}")
            elif not torch.equal(got, part):
                rows = (got != part).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
                problems.append(f"{key} (tp rank {rank}): values differ in rows {rows[:8]} of {got.shape[0]}")
    if sorted(used) != sorted(want):
        problems.append(f"Hugging Face tensors mbridge maps reshard's names to: "
                        f"missing {sorted(set(want) - set(used))}, "
                        f"not in the checkpoint {sorted(set(used) - set(want))}, "
                        f"more than once {sorted({n for n in used if used.count(n) > 1})}")
    return problems


def _check_family(name: str, tp: int, root: Path, auto_bridge) -> list[str]:
    """What differs between reshard's rank files and mbridge's tensors for one family (empty: nothing)."""
    from safetensors.torch import load_file

    config = _save_tiny(name, root / "hf")
    hf = load_file(root / "hf" / "model.safetensors")
    reshard.convert(root / "hf", root / "m", format="megatron", to=f"tp={tp},pp=1")
    args, models = _rank_files(root / "m", tp)

    bridge = _bridge(auto_bridge, config, tp)
    problems = []
    if args["padded_vocab_size"] != bridge.padded_vocab_size:
        problems.append(f"padded vocabulary: reshard {args['padded_vocab_size']}, mbridge {bridge.padded_vocab_size}")
    problems += _compare(bridge, hf, models, list(models[0]), list(hf))
    return [f"{name} tp={tp}: {p}" for p in problems]


@pytest.mark.interop
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_gives_the_tensors_mbridge_builds(tmp_path, tp):
    auto_bridge = _mbridge()
    families = _shared_families(auto_bridge)
    assert families, "no model family both reshard and mbridge know"
    problems = [p for name in families for p in _check_family(name, tp, tmp_path / name, auto_bridge)]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def deepseek_v3_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 with 61 decoder layers and one MTP layer, every tensor random bf16; its config, its
    tensors, its folder. transformers saves the model's two layers (a dense one, a MoE one); layers 2 .. 60 are
    written here under the MoE layer's names (building 61 layers in transformers takes seconds), and so is the MTP
    layer ``model.layers.61.*``, which ``save_pretrained`` does not write: a MoE decoder layer with ``enorm``,
    ``hnorm``, ``eh_proj`` [h, 2h] and ``shared_head.norm``, as DeepSeek-V3's release stores it (without the
    embedding and head copies)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("deepseek_v3_mtp") / "hf"
    config = _save_tiny("deepseek_v3", path, num_nextn_predict_layers=1)
    hf = load_file(path / "model.safetensors")
    moe, mtp = f"model.layers.{config.num_hidden_layers - 1}.", f"model.layers.{MTP_LAYER}."
    assert config.first_k_dense_replace < config.num_hidden_layers and not any(n.startswith(mtp) for n in hf)
    shapes = {f"model.layers.{i}.{n[len(moe):]}": v.shape for n, v in hf.items() if n.startswith(moe)
              for i in range(config.num_hidden_layers, MTP_LAYER + 1)}
    h = config.hidden_size
    shapes |= {mtp + "enorm.weight": (h,), mtp + "hnorm.weight": (h,), mtp + "eh_proj.weight": (h, 2 * h),
               mtp + "shared_head.norm.weight": (h,)}
    generator = torch.Generator().manual_seed(1)
    hf |= {n: torch.randn(shape, generator=generator).to(torch.bfloat16) for n, shape in shapes.items()}
    save_file(hf, path / "model.safetensors", metadata={"format": "pt"})
    config.num_hidden_layers = MTP_LAYER
    config.save_pretrained(path)
    return config, hf, path


@pytest.mark.interop
@pytest.mark.parametrize("tp", [1, 2])
def test_deepseek_v3_mtp_layer_to_megatron_gives_the_tensors_mbridge_builds(tmp_path, tp, deepseek_v3_mtp):
    """reshard's ``mtp.layers.0.*`` (and every other tensor) hold what mbridge builds from the Hugging Face
    checkpoint, bit for bit, and mbridge maps them back to each Hugging Face name once, layer 61's included."""
    config, hf, path = deepseek_v3_mtp
    reshard.convert(path, tmp_path / "m", format="megatron", to=f"tp={tp},pp=1")
    args, models = _rank_files(tmp_path / "m", tp)
    assert (args["num_layers"], args["mtp_num_layers"]) == (MTP_LAYER, 1)
    keys = list(models[0])
    mtp_keys = [k for k in keys if k.startswith("mtp.layers.0.")]
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight" in mtp_keys, mtp_keys
    # megatron-core's eh_proj is a ColumnParallelLinear (gather_output=False), split on its output dim; mbridge
    # takes a plain tensor's split dim from the local shape it is given (reshard's), so that shape is checked here
    h = config.hidden_size
    assert tuple(models[0]["mtp.layers.0.eh_proj.weight"].shape) == (h // tp, 2 * h)

    bridge = _bridge(_mbridge(), config, tp)
    problems = _compare(bridge, hf, models, keys, list(hf))
    assert not problems, "\n".join(f"deepseek_v3 + MTP tp={tp}: {p}" for p in problems)
    mapped = [n for k in mtp_keys for n in bridge._weight_name_mapping_mcore_to_hf(_mbridge_name(k))]
    assert sorted(mapped) == sorted(n for n in hf if n.startswith(f"model.layers.{MTP_LAYER}.")), mapped
