"""Hugging Face checkpoints of Llama-style and GPT-2 models: ``config.json`` plus safetensors weights.

A directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with the shards it names
(``model-00001-of-0000N.safetensors``, ...). Every tensor is stored whole and
unsharded under its Hugging Face name, which is also its logical name, so
the layout is the spec resolved at the trivial topology: ``hf-llama`` (or
``hf-llama-tied``) for ``LlamaForCausalLM``, ``hf-mixtral`` for
``MixtralForCausalLM`` (``model_type`` ``"mixtral"``, experts stored per expert),
``hf-gpt2`` for a config with
``model_type`` ``"gpt2"`` (``GPT2LMHeadModel``: output layer tied, Conv1D
weights stored ``[in, out]``). Not supported: GPT-2 files of old
``transformers`` versions (names without the ``transformer.`` prefix,
``attn.bias`` mask buffers) and untied GPT-2; they fail as unmatched tensors.

Reading checks both ways, before any tensor byte is read: every item the
spec expects is stored with the expected shape, and every stored tensor is
an item of the spec (fail closed: an unknown tensor is an error, never
skipped). Writing streams each tensor from ``fill`` in windows of at most
8 MiB into files laid out as ``save_pretrained`` lays them out. A Hugging
Face checkpoint holds model weights only (state ``param``).
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.core.catalog import available_specs, load_spec
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.core.dtypes import SUPPORTED
from reshard.formats.base import (Fill, Located, Source, Target, check_sizes, given_sizes, itemsize,
                                  read_json, stream_item)
from reshard.core.layout import Item, Layout
from reshard.core.resolve import resolve
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsWriter, TensorInfo, plan_shards, read_header
from reshard.core.topology import Topology

__all__ = ["FORMAT", "HFFormat", "llama_config", "llama_config_near", "sizes_from_config"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SPEC = "hf-llama"
TIED_SPEC = "hf-llama-tied"
GPT2_SPEC = "hf-gpt2"
MIXTRAL_SPEC = "hf-mixtral"
LLAMA_FAMILY = ("llama", "mixtral")
"""``model_type``s whose config.json ``sizes_from_config`` reads."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""huggingface_hub's default; transformers 5's ``save_pretrained`` defaults to 50GB."""
WINDOW_BYTES = 8 << 20
"""Most bytes asked of ``fill`` at once."""
_MAX_LISTED = 20  # problems listed in one error before "... and N more"
_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")  # Llama: model.layers.N., GPT-2: transformer.h.N.


class HFFormat:
    """The ``hf`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return (path / CONFIG_NAME).is_file() and ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file())

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``config.json`` and the safetensors headers, and match every stored tensor to the spec.

        ``Source.extra["config"]`` is the parsed ``config.json``
        (``extra["generation_config"]`` too when the directory has one).

        Raises:
          CheckpointFormatError: a file is missing or malformed, the model is
            tied and no tied spec is shipped, or the stored tensors do not
            match the spec (all mismatches listed, each with its file).
        """
        path = Path(path)
        config_path = path / CONFIG_NAME
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise CheckpointFormatError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        spec_name = spec or _spec_for_config(config, config_path)
        stored = _stored_tensors(path)
        model_sizes = (gpt2_sizes_from_config if spec_name == GPT2_SPEC else sizes_from_config)(config, config_path,
                                                                                               len(stored))
        model_sizes.update(given_sizes(sizes))
        spec_obj = load_spec(spec_name)
        layout = resolve(spec_obj, Topology(), model_sizes)
        _check_param_only(layout, spec_name)
        where: dict[Item, Located] = {}
        problems: list[str] = []
        matched: set[str] = set()
        for item, info in layout.items.items():
            hit = stored.get(item.key)
            if hit is None:
                problems.append(f"tensor '{item.key}' is missing (spec rule '{info.rule}')")
                continue
            file, tensor = hit
            matched.add(item.key)
            if tensor.shape != info.shape:
                problems.append(f"{file}: tensor '{item.key}' has shape {list(tensor.shape)}, "
                                f"the spec expects {list(info.shape)}")
            elif tensor.dtype not in SUPPORTED:
                problems.append(f"{file}: tensor '{item.key}' has dtype {tensor.dtype}, which reshard cannot copy "
                                f"(supported: {', '.join(SUPPORTED)})")
            else:
                where[item] = Located(file, tensor.data_offset, tensor.dtype)
        for name, (file, _) in stored.items():
            if name not in matched:
                problems.append(f"{file}: tensor '{name}' matches no item of spec '{spec_name}'")
        if problems:
            model_type = config.get("model_type")
            hint = f" (config model_type {json.dumps(model_type)})" if model_type not in (None, *LLAMA_FAMILY) else ""
            raise CheckpointFormatError(
                f"{path}: the stored tensors do not match spec '{spec_name}'{hint}:\n  " + _listing(problems))
        extra: dict[str, Any] = {"config": config}
        generation = path / GENERATION_CONFIG_NAME
        if generation.is_file():
            extra["generation_config"] = read_json(generation)
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                      sizes=model_sizes, layout=layout, where=where, extra=extra)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The unsharded layout of ``source``'s model, with a ``config.json`` for it.

        ``Target.extra["config"]`` is the source's own config when the source
        is hf, otherwise a minimal ``LlamaConfig`` built from the sizes (edit
        it before ``write`` to set rope, epsilon or token ids).
        ``Target.extra["max_shard_size"]`` (bytes, or a string like ``"5GB"``)
        may be set to change the shard size (default 5GB).

        Raises:
          TopologyError: ``topology`` is sharded (hf checkpoints are not).
          CheckpointFormatError: the source's model is tied and no tied spec is shipped.
        """
        axes = ("tp", "pp", "dp", "cp", "ep", "vpp")
        sharded = [f"{a}({topology.degree(a)})" for a in axes if topology.degree(a) > 1]
        if sharded:
            raise TopologyError(f"hf checkpoints are unsharded: cannot write {', '.join(sharded)} (use tp=1,pp=1,dp=1)")
        from_hf = source.format == self.name
        spec_name = spec or (source.spec_name if from_hf else _spec_for_source(source))
        spec_obj = load_spec(spec_name)
        layout = resolve(spec_obj, Topology(), source.sizes)
        _check_param_only(layout, spec_name)
        dtypes = _target_dtypes(source, layout)
        if from_hf:
            extra = {k: copy.deepcopy(v) for k, v in source.extra.items() if k in ("config", "generation_config")}
        elif spec_name == GPT2_SPEC:
            extra = {"config": gpt2_config(source.sizes, dtypes.values())}
        else:
            extra = {"config": _llama_target_config(source, dtypes.values(), tied=spec_name == TIED_SPEC)}
        return Target(format=self.name, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                      sizes=dict(source.sizes), layout=layout, dtypes=dtypes, extra=extra)

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        """Write the safetensors shards, the index (when there are several shards) and ``config.json``.

        Item bytes come in windows of at most ``window_bytes`` (default ``WINDOW_BYTES``).
        With ``only``, just those shards, and not the index or ``config.json``.

        Tensors are ordered embedding, layer 0, layer 1, ..., then the rest,
        split into shards as ``save_pretrained`` splits them; each shard file
        is byte-identical to what ``safetensors.torch.save_file`` writes for
        its tensors with metadata ``{"format": "pt"}``.

        Raises:
          CheckpointFormatError: the target holds a state other than ``param``,
            an item has no dtype, or ``fill`` returns the wrong number of bytes.
        """
        out = Path(out)
        items, by_key, dtype_of, shards = _shard_plan(target)
        written: list[Path] = []
        for file, names in shards.shards:
            if only is not None and Path(file) not in set(only):
                continue
            spec = {n: (dtype_of[by_key[n]], target.layout.items[by_key[n]].shape) for n in names}
            with SafetensorsWriter(out / file, spec, metadata={"format": "pt"}) as w:
                for name in w.order:
                    it = by_key[name]
                    stream_item(fill, it, target.layout.items[it].numel, dtype_of[it],
                                lambda data, name=name: w.write(name, data), progress, window_bytes or WINDOW_BYTES)
            written.append(Path(file))
        if only:  # a worker's share: index and configs are written by the call with only=()
            return written
        if shards.sharded:
            total_parameters = sum(target.layout.items[it].numel for it in items)
            (out / INDEX_NAME).write_text(shards.index_json(total_parameters), encoding="utf-8")
            written.append(Path(INDEX_NAME))
        config = target.extra.get("config") or llama_config(target.sizes, dtype_of.values())
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(Path(CONFIG_NAME))
        if "generation_config" in target.extra:
            text = json.dumps(target.extra["generation_config"], indent=2, sort_keys=True) + "\n"
            (out / GENERATION_CONFIG_NAME).write_text(text, encoding="utf-8")
            written.append(Path(GENERATION_CONFIG_NAME))
        return written

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The shard, relative to the checkpoint directory, that holds each item of ``target``."""
        items, _, _, shards = _shard_plan(target)
        where = shards.weight_map
        return {it: Path(where[it.key]) for it in items}


FORMAT = HFFormat()


def sizes_from_config(config: Mapping[str, Any], where: Path | str = CONFIG_NAME,
                      tensors: int | None = None) -> dict[str, int]:
    """The llama spec's sizes from a Hugging Face config: h, heads, g, hd, f, vocab, layers.

    ``g`` defaults to ``heads`` (no GQA) and ``hd`` to ``h // heads``, as
    ``LlamaConfig`` does. Raises CheckpointFormatError listing every missing
    or non-positive key, or a size out of bounds (with ``tensors``, the number of
    tensors stored: each layer and expert holds one at least).
    """
    keys = {"h": "hidden_size", "heads": "num_attention_heads", "f": "intermediate_size",
            "vocab": "vocab_size", "layers": "num_hidden_layers"}
    sizes = _config_ints(config, keys, ("num_key_value_heads", "head_dim"), where)
    sizes["g"] = int(config.get("num_key_value_heads") or sizes["heads"])
    sizes["hd"] = int(config.get("head_dim") or sizes["h"] // sizes["heads"])
    if config.get("model_type") == "mixtral":
        sizes.update(_config_ints(config, {"experts": "num_local_experts"}, (), where))
    return check_sizes(sizes, where, counts=None if tensors is None else dict.fromkeys(("layers", "experts"), tensors))


def llama_config_near(*dirs: Path, tensors: int | None = None) -> tuple[dict[str, int], dict[str, Any] | None]:
    """Sizes and config from the first Llama ``config.json`` in ``dirs`` (for formats that store none of their own);
    ``tensors`` bounds the layer and expert counts as ``sizes_from_config`` says."""
    for d in dirs:
        candidate = Path(d) / CONFIG_NAME
        if candidate.is_file():
            config = read_json(candidate)
            if isinstance(config, dict) and config.get("model_type") in LLAMA_FAMILY:
                return sizes_from_config(config, candidate, tensors), config
    return {}, None


def llama_config(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """A minimal ``LlamaConfig`` dict for model ``sizes``; other fields keep transformers' defaults.

    ``dtype`` is the most common of ``dtypes`` (transformers 5's name for
    ``torch_dtype``); ``rms_norm_eps`` is 1e-5 (Llama 2/3 and Megatron's default).
    """
    missing = [k for k in ("h", "f", "heads", "g", "hd", "layers", "vocab") if k not in sizes]
    if missing:
        raise CheckpointFormatError(f"cannot build a Llama config.json: model sizes {', '.join(missing)} are unknown")
    common = Counter(dtypes).most_common(1)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": sizes["h"],
        "intermediate_size": sizes["f"],
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["g"],
        "head_dim": sizes["hd"],
        "num_hidden_layers": sizes["layers"],
        "vocab_size": sizes["vocab"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    if common:
        config["dtype"] = common[0][0]
    return config


def _llama_target_config(source: Source, dtypes: Any, *, tied: bool) -> dict[str, Any]:
    """The source's own Llama ``config.json`` when it carries one (DeepSpeed, DCP, UCP beside their files), else
    one built from the sizes and the source's hints (Megatron's args: epsilon, rope base, positions); the
    tying and dtype always as written."""
    carried = source.extra.get("config")
    if isinstance(carried, Mapping) and carried.get("model_type") in LLAMA_FAMILY:
        config = copy.deepcopy(dict(carried))
        common = Counter(dtypes).most_common(1)
        if common:
            config.pop("torch_dtype", None)
            config["dtype"] = common[0][0]
    elif "experts" in source.sizes and isinstance((source.extra.get("config_hints") or {}).get("num_experts_per_tok"), int):
        config = llama_config(source.sizes, dtypes)  # a Megatron MoE run: its args name the routing
        config.update(source.extra["config_hints"])
    elif "experts" in source.sizes:
        raise CheckpointFormatError(f"{source.path}: a mixture-of-experts model without its config.json (the number of "
                                    "experts each token is routed to is not in the weights); put it beside the source")
    else:
        config = llama_config(source.sizes, dtypes)
        config.update(source.extra.get("config_hints") or {})
    config["tie_word_embeddings"] = tied
    return config


def _config_ints(config: Mapping[str, Any], keys: Mapping[str, str], optional: tuple[str, ...],
                 where: Path | str) -> dict[str, int]:
    """Size variable -> value of the required config ``keys``; every missing or non-positive one listed at once."""
    bad = [f"'{k}' is missing" for k in keys.values() if config.get(k) is None]
    for k in (*keys.values(), *optional):
        v = config.get(k)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            bad.append(f"'{k}' must be a positive integer, got {json.dumps(v)}")
    if bad:
        raise CheckpointFormatError(f"{where}: " + "; ".join(bad))
    return {var: int(config[k]) for var, k in keys.items()}


def gpt2_sizes_from_config(config: Mapping[str, Any], where: Path | str = CONFIG_NAME,
                           tensors: int | None = None) -> dict[str, int]:
    """The gpt2 spec's sizes from a ``GPT2Config``: h, heads, hd, f, vocab, positions, layers."""
    keys = {"h": "n_embd", "heads": "n_head", "vocab": "vocab_size", "layers": "n_layer", "positions": "n_positions"}
    sizes = _config_ints(config, keys, ("n_inner",), where)
    sizes["hd"] = sizes["h"] // sizes["heads"]
    sizes["f"] = int(config.get("n_inner") or 4 * sizes["h"])  # GPT2Config: n_inner None means 4 * n_embd
    return check_sizes(sizes, where, counts=None if tensors is None else {"layers": tensors})


def gpt2_config(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """A minimal ``GPT2Config`` dict for model ``sizes``; other fields keep transformers' defaults."""
    missing = [k for k in ("h", "f", "heads", "hd", "layers", "vocab", "positions") if k not in sizes]
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


def _spec_for_config(config: Mapping[str, Any], where: Path) -> str:
    if config.get("model_type") == "gpt2":
        return GPT2_SPEC
    if config.get("model_type") == "mixtral":
        if config.get("tie_word_embeddings", False):
            raise CheckpointFormatError(f"{where}: tied Mixtral checkpoints are not supported yet")
        return MIXTRAL_SPEC
    # LlamaConfig's default is untied; a config without the key is untied.
    if not config.get("tie_word_embeddings", False):
        return SPEC
    if TIED_SPEC in available_specs():
        return TIED_SPEC
    raise CheckpointFormatError(f"{where}: tied HF checkpoints are not supported yet (tie_word_embeddings is true)")


def _spec_for_source(source: Source) -> str:
    if "transformer.wte.weight" in source.layout.tensors:
        return GPT2_SPEC
    if "experts" in source.sizes or any(".block_sparse_moe." in n for n in source.layout.tensors):
        return MIXTRAL_SPEC
    if "lm_head.weight" in source.layout.tensors:
        return SPEC
    if TIED_SPEC in available_specs():
        return TIED_SPEC
    raise CheckpointFormatError(
        f"{source.path}: tied HF checkpoints are not supported yet (the source has no separate lm_head.weight)")


def _check_param_only(layout: Layout, spec_name: str) -> None:
    if layout.states not in ((), ("param",)):
        raise CheckpointFormatError(
            f"spec '{spec_name}' declares states {', '.join(layout.states)}; "
            "hf checkpoints hold model weights (param) only")


def _stored_tensors(path: Path) -> dict[str, tuple[Path, TensorInfo]]:
    """Every tensor of the checkpoint: name -> (file, header entry), cross-checked with the index."""
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file() and index.is_file():
        raise CheckpointFormatError(
            f"{path}: holds both {WEIGHTS_NAME} and {INDEX_NAME}; transformers would load {WEIGHTS_NAME} "
            f"and ignore the index, so remove the one that is stale")
    if single.is_file():
        return {name: (single, t) for name, t in read_header(single).tensors.items()}
    if not index.is_file():
        raise CheckpointFormatError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}")
    weight_map = _weight_map(index)
    out: dict[str, tuple[Path, TensorInfo]] = {}
    problems: list[str] = []
    for file in dict.fromkeys(weight_map.values()):
        shard = path / file
        if not shard.is_file():
            problems.append(f"{index}: names {file}, which does not exist")
            continue
        for name, t in read_header(shard).tensors.items():
            if name in out:
                problems.append(f"tensor '{name}' is stored twice, in {out[name][0]} and {shard}")
            elif weight_map.get(name) != file:
                listed = f"maps it to {weight_map[name]}" if name in weight_map else "does not list it"
                problems.append(f"{shard}: holds tensor '{name}' but {index.name} {listed}")
            else:
                out[name] = (shard, t)
    for name, file in weight_map.items():
        if name not in out and (path / file).is_file():
            problems.append(f"{index.name}: maps tensor '{name}' to {file}, which does not hold it")
    if problems:
        raise CheckpointFormatError(f"{path}: the index and the shards disagree:\n  " + _listing(problems))
    return out


def _weight_map(index: Path) -> dict[str, str]:
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{index}: expected an object with a 'weight_map' object")
    for name, file in weight_map.items():
        # Shard names are plain file names in the checkpoint directory; anything else could read outside it.
        if not isinstance(file, str) or not file or PurePosixPath(file).name != file or file in (".", ".."):
            raise CheckpointFormatError(
                f"{index}: weight_map maps '{name}' to {json.dumps(file)}, not a file name in the checkpoint directory")
    return weight_map


def _listing(problems: list[str]) -> str:
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    return "\n  ".join(shown + ([f"... and {more} more"] if more else []))


def _target_dtypes(source: Source, layout: Layout) -> dict[Item, str]:
    """Each target item's dtype: that of the source item holding its tensor's weights (float32 if none)."""
    by_tensor: dict[str, str] = {}
    for f in source.layout.fragments:
        if f.state == "param" and not f.fill and f.item in source.where:
            by_tensor.setdefault(f.tensor, source.where[f.item].dtype)
    out: dict[Item, str] = {}
    for f in layout.fragments:
        if f.item not in out and f.tensor in by_tensor:
            out[f.item] = by_tensor[f.tensor]
    return {it: out.get(it, "float32") for it in layout.items}


def _ordered_items(layout: Layout) -> list[Item]:
    """Items in the order a model's state dict has them: leading items, layer 0, layer 1, ..., trailing items.

    The spec registers items rule by rule (all input norms, then all q_proj, ...);
    regrouping by layer keeps each layer's tensors together in one shard.
    """
    registered = list(dict.fromkeys(it for items in layout.order.values() for it in items if it in layout.items))
    registered += sorted(set(layout.items) - set(registered))
    first = next((k for k, it in enumerate(registered) if _LAYER.search(it.key)), len(registered))

    def rank(k: int) -> tuple[int, int, int]:
        m = _LAYER.search(registered[k].key)
        if m:
            return (1, int(m.group(1)), k)
        return (0 if k < first else 2, 0, k)

    return [registered[k] for k in sorted(range(len(registered)), key=rank)]


def _shard_plan(target: Target) -> tuple[list[Item], dict[str, Item], dict[Item, str], Any]:
    """The target's items in state-dict order, by key, their dtypes, and how they split into shards."""
    others = sorted({it.state for it in target.layout.items} - {"param"})
    if others:
        raise CheckpointFormatError(
            f"hf checkpoints hold model weights only; the target layout also has states {', '.join(others)}")
    items = _ordered_items(target.layout)
    by_key: dict[str, Item] = {}
    for it in items:
        if it.key in by_key:
            raise CheckpointFormatError(f"two target items are both named '{it.key}': {by_key[it.key]} and {it}")
        by_key[it.key] = it
    dtype_of = {}
    for it in items:
        if it not in target.dtypes:
            raise CheckpointFormatError(f"target item {it} has no dtype")
        dtype_of[it] = target.dtypes[it]
    sizes = [(it.key, target.layout.items[it].numel * itemsize(dtype_of[it])) for it in items]
    return items, by_key, dtype_of, plan_shards(sizes, target.extra.get("max_shard_size", DEFAULT_MAX_SHARD_SIZE))
