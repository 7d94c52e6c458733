"""Any Hugging Face causal-LM folder, built and loaded through `transformers` itself.

`hf.py` maps Llama configs onto megatrain's own Llama class without `transformers`. This
module covers every architecture `transformers` can build as a causal LM (Qwen, Mistral,
Gemma, Phi, MoE models, ...) by letting `transformers` build the module tree, so the math
is the library's and nothing is re-implemented here. The CLI's order is kept:

    built = build_meta(folder)                 # meta tensors: plan memory, nothing allocated
    check_weights(built.model, folder)         # file headers only: refuse before any work
    model = load_pretrained(folder)            # fp32 CPU weights, one tensor at a time
    save_pretrained(model, out, dtype="bf16")  # a folder transformers loads back

Checkpoint names are not always model names: transformers 5 renames and fuses tensors while
loading (per-expert `mlp.experts.{e}.gate_proj.weight` become one fused
`mlp.experts.gate_up_proj` parameter) and reverses that when saving. `check_weights` runs
transformers' own loader (`core_model_loading.convert_and_load_state_dict_in_model`, with
the transforms of `conversion_mapping.get_model_conversion_mapping`) on meta tensors made
from the file headers, so it gets the missing/unexpected/mismatched lists a real load
would, without reading a weight.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from . import RefusedError

INSTALL = 'pip install "megatrain[hf]"'
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# File dtypes that cast to fp32 without losing meaning. Integer or fp8 weights are
# quantised: they need scales and a dequantiser megatrain does not have.
_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16}
_INTS = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
         "U8": torch.uint8, "BOOL": torch.bool}
_DTYPES = _FLOATS | _INTS
_FIX = "use the config.json that came with these weights (or weights made for this config)"


def require_transformers():
    """The `transformers` module, 5.x (its loader does the checkpoint name conversions)."""
    try:
        import transformers
    except ImportError as e:
        raise RefusedError(f"a Hugging Face model folder needs the `transformers` package ({e}); "
                           f"install it with: {INSTALL}") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise RefusedError(f"transformers {transformers.__version__} is too old for Hugging Face "
                           f"model folders (5.x renames checkpoint tensors while loading); "
                           f"upgrade it with: {INSTALL}")
    return transformers


# ----------------------------------------------------------------------------- building

class MetaModel(NamedTuple):
    model: torch.nn.Module   # on the meta device: names and shapes, no storage
    config: object           # the transformers config: use_cache=False, attention chosen
    notes: list[str]         # what differs from the defaults, for the user to read


def read_config(folder: str | Path):
    """The folder's config through AutoConfig; refused when transformers cannot read it."""
    tf = require_transformers()
    f = Path(folder) / "config.json"
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RefusedError(f"--model {folder}: cannot read {f} ({e}); it must be a Hugging Face "
                           f"config.json") from None
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise RefusedError(f"{f}: the weights are quantised ({method}); megatrain trains fp32 "
                           f"weights and cannot dequantise them; use the unquantised "
                           f"(bf16/fp16/fp32) checkpoint of this model")
    try:
        config = tf.AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError, TypeError) as e:
        why = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise RefusedError(f"{f}: transformers {tf.__version__} cannot read model_type "
                           f"{raw.get('model_type')!r} ({why}); use a folder whose config.json "
                           f"has a model_type this transformers knows, or upgrade it "
                           f"(pip install -U transformers)") from None
    config.use_cache = False   # training runs whole sequences: a KV cache only holds memory
    return config


def _from_config(tf, config, attn):
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                               dtype=torch.float32)


def build_meta(folder: str | Path) -> MetaModel:
    """The folder's model with meta tensors: exact names and shapes, no memory.

    SDPA attention is asked for (fast, no seq x seq scores kept). transformers refuses it
    for some architectures at construction (Gemma2, ...): those fall back to eager attention,
    with a note, since eager attention holds every layer's full score matrix.
    """
    tf = require_transformers()
    config = read_config(folder)
    where = f"{Path(folder) / 'config.json'}: model_type {getattr(config, 'model_type', None)!r}"
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise RefusedError(f"{where} ({type(config).__name__}) is not a causal language model "
                           f"transformers can build (AutoModelForCausalLM has no class for "
                           f"it); megatrain train needs a decoder (causal LM) checkpoint")
    notes: list[str] = []
    with torch.device("meta"):
        try:
            try:
                model = _from_config(tf, config, "sdpa")
            except ValueError as e:
                if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e):
                    raise
                model = _from_config(tf, config, "eager")
                notes.append(f"{type(model).__name__} has no SDPA attention in transformers "
                             f"{tf.__version__}; using eager attention (slower, keeps the "
                             f"seq x seq scores of every layer)")
        except (ValueError, TypeError, ImportError) as e:
            why = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise RefusedError(f"{where}: transformers cannot build it ({why})") from None
    return MetaModel(model, config, notes)


def build_model(config) -> torch.nn.Module:
    """A real fp32 CPU model, transformers' random init (for a folder without weights)."""
    return _from_config(require_transformers(), config, config._attn_implementation)


def model_dims(config) -> dict[str, int]:
    """What the memory plan reads (plan.plan_memory), under megatrain's LlamaConfig names."""
    t = config.get_text_config()
    ffn = getattr(t, "intermediate_size", None) or getattr(t, "moe_intermediate_size", None)
    return {"hidden": int(t.hidden_size), "ffn": int(ffn or 4 * t.hidden_size),
            "heads": int(t.num_attention_heads), "layers": int(t.num_hidden_layers),
            "vocab_size": int(t.vocab_size),
            "max_seq": int(getattr(t, "max_position_embeddings", None) or 2048)}


def param_count(model: torch.nn.Module) -> int:
    """Parameters, tied ones once (parameters() de-duplicates shared tensors)."""
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ checking

@dataclass
class WeightReport:
    files: list[Path]                                     # empty: the folder has no weights
    tensors: int = 0
    bytes: int = 0                                        # on disk, all shards
    dtypes: dict[str, int] = field(default_factory=dict)  # e.g. {"BF16": 291}
    ignored: list[str] = field(default_factory=list)      # old buffers the model recomputes
    names_checked: bool = True   # False: this transformers lacks the loader API used here


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files transformers would load, in its order of preference."""
    folder = Path(folder)
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    if (folder / INDEX).is_file():
        try:
            files = sorted({folder / n for n in
                            json.loads((folder / INDEX).read_text())["weight_map"].values()})
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise RefusedError(f"{folder / INDEX}: unreadable ({e!r}); it must list the shards "
                               f"under weight_map") from None
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise RefusedError(f"{folder / INDEX}: lists shards that are not in {folder}: "
                               f"{absent[:4]}; copy the whole model folder")
        return files
    pickles = sorted(p.name for p in [*folder.glob("pytorch_model*.bin"), *folder.glob("*.pt")])
    if pickles:
        raise RefusedError(f"--model {folder}: has only pickle weights ({pickles[0]}); "
                           f"megatrain reads safetensors only (pickles can run code): convert "
                           f"them to safetensors (load with transformers and save_pretrained), "
                           f"or remove them to start from random weights")
    other = sorted(p.name for p in folder.glob("*.safetensors"))
    if other:
        raise RefusedError(f"--model {folder}: {other[0]} is not the Hugging Face layout "
                           f"({SINGLE} or {INDEX} with its shards); convert it with transformers")
    return []


def _header(path: Path) -> dict[str, tuple[str, tuple, int]]:
    """{name: (dtype, shape, data offset)} of a safetensors file: an 8-byte length, a JSON
    header {name: {dtype, shape, data_offsets}}, then the data. Nothing else is read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            head = json.loads(f.read(n)) if 8 + n <= size else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            head = None
    if not isinstance(head, dict):
        raise RefusedError(f"{path}: not a safetensors file (bad header); the file is damaged")
    head.pop("__metadata__", None)
    out = {}
    for name, h in head.items():
        (begin, end), item = h["data_offsets"], _DTYPES.get(h["dtype"])
        if item and (end - begin != math.prod(h["shape"]) * item.itemsize or 8 + n + end > size):
            raise RefusedError(f"{path}: {name} runs past the end of the file or has a wrong "
                               f"size; the file is damaged or truncated")
        out[name] = (h["dtype"], tuple(h["shape"]), 8 + n + begin)
    return out


def check_weights(meta_model: torch.nn.Module, folder: str | Path) -> WeightReport:
    """Check the folder's safetensors against the model from the file headers alone.

    Refused (RefusedError naming the tensor and its file): a missing tensor, an unexpected
    one, a shape the config does not make, a dtype that is not floating point (quantised).
    Tied weights absent from the files and old `rotary_emb.inv_freq` buffers are fine, as
    in transformers. Returns what was found.
    """
    tf = require_transformers()
    report = WeightReport(files=weight_files(folder))
    expected = meta_model.state_dict()
    where: dict[str, Path] = {}
    fake: dict[str, torch.Tensor] = {}
    for f in report.files:
        for name, (dt, shape, _) in _header(f).items():
            if name in where:
                raise RefusedError(f"{f}: {name} is also in {where[name].name}; a tensor must "
                                   f"be in one shard only")
            mine = expected.get(name)
            dtype = _FLOATS.get(dt) or (mine.dtype if mine is not None and
                                        _INTS.get(dt) == mine.dtype else None)
            if dtype is None:   # integer buffers the model keeps as integers are fine
                raise RefusedError(f"{f}: {name} is {dt}, not fp32/fp16/bf16 (quantised "
                                   f"weights?); megatrain trains fp32 weights and cannot "
                                   f"dequantise; use the bf16/fp16/fp32 checkpoint")
            where[name] = f
            fake[name] = torch.empty(shape, dtype=dtype, device="meta")
            report.tensors += 1
            report.bytes += dtype.itemsize * math.prod(shape)
            report.dtypes[dt] = report.dtypes.get(dt, 0) + 1
    report.ignored = sorted(n for n in fake if n.endswith("rotary_emb.inv_freq"))
    if not fake:
        return report
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            convert_and_load_state_dict_in_model,
            rename_source_key,
        )
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError:   # a later transformers moved them: load_pretrained still checks
        report.names_checked = False
        return report
    work = copy.deepcopy(meta_model)   # the loader swaps in new (meta) parameters
    mapping = get_model_conversion_mapping(work)
    conv = [m for m in mapping if isinstance(m, WeightConverter)]
    ren = [m for m in mapping if not isinstance(m, WeightConverter)]
    origin: dict[str, list[str]] = {}  # model name -> checkpoint names, to name files
    for name in fake:
        target = rename_source_key(name, ren, conv, work.base_model_prefix, expected)[0]
        origin.setdefault(target, []).append(name)
    config = LoadStateDictConfig(device_map={"": "meta"}, dtype=torch.float32,
                                 weight_mapping=mapping)
    logs, bar = tf.utils.logging, tf.utils.logging.is_progress_bar_enabled()
    logs.disable_progress_bar()   # it would say "Loading weights" while nothing is read
    try:
        info, _ = convert_and_load_state_dict_in_model(work, fake, config)
    finally:
        if bar:
            logs.enable_progress_bar()
    # as from_pretrained's _finalize_model_loading: tied targets and known extras are fine
    work.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
    work._adjust_missing_and_unexpected_keys(info)
    located = {t: f"{src[0]} in {where[src[0]]}"
               + (f" and {len(src) - 1} more" if len(src) > 1 else "") for t, src in origin.items()}
    _refuse_mismatch(folder, report.files, located, info.missing_keys, info.unexpected_keys,
                     info.mismatched_keys, info.conversion_errors)
    return report


def _refuse_mismatch(folder, files, located, missing, unexpected, mismatched, errors) -> None:
    """One RefusedError for what transformers' loader reported, tensors and files named.

    located: model tensor name -> "checkpoint name in file" (they differ when converted).
    """
    if mismatched:
        name, got, want = min(mismatched, key=str)
        more = f" ({len(mismatched)} tensors disagree)" if len(mismatched) > 1 else ""
        raise RefusedError(f"{located.get(name, name)}: shape {tuple(got)}, but config.json "
                           f"makes {name} {tuple(want)}{more}; {_FIX}")
    if errors:
        name, msg = min(errors.items(), key=str)
        # transformers' text: a traceback, the exception's message, then an "Error: ..." line
        lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()] or ["?"]
        why = next((ln for ln in reversed(lines) if not ln.startswith("Error")), lines[-1])
        raise RefusedError(f"cannot build {name} from {located.get(name, 'its tensors')} "
                           f"({why}); a tensor it is made of is missing or has another shape; "
                           f"{_FIX}")
    if missing or unexpected:
        src = files[0] if len(files) == 1 else Path(folder) / INDEX
        parts = [f"missing {sorted(missing)[:6]} (not in {src})"] if missing else []
        if unexpected:
            parts.append("unexpected " + ", ".join(located.get(n, f"{n} in {src}")
                                                    for n in sorted(unexpected)[:6]))
        raise RefusedError(f"the weights in {folder} do not match config.json: "
                           f"{'; '.join(parts)}; {_FIX}")


# ------------------------------------------------------------------------------ loading

_CHUNK = 1 << 20   # elements cast per step from a 16-bit file: a 2 MiB buffer
_local = threading.local()


class _Lazy:
    """A tensor still in its file; transformers' loader reads it with `[...]` when it wants it.

    It comes back as fp32 (integers as they are) with no second copy: fp32 data is read into
    the storage that becomes the parameter; bf16/fp16 data is read a chunk at a time into a
    small buffer and cast into it. (safetensors' mmap keeps the file pages it touched in the
    process until the file closes; its pread backend reads into a buffer and copies that.)
    from_pretrained deep-copies its arguments: this object is shared instead.
    """
    __slots__ = ("dtype", "offset", "path", "shape")

    def __init__(self, path: Path, dt: str, shape: tuple, offset: int):
        self.path, self.dtype, self.shape, self.offset = path, _DTYPES[dt], shape, offset

    def __deepcopy__(self, memo):
        return self

    def __getitem__(self, idx):
        out = torch.empty(self.shape, dtype=torch.float32 if self.dtype.is_floating_point
                          else self.dtype)
        flat = out.view(-1)
        with open(self.path, "rb", buffering=0) as f:
            if out.dtype == self.dtype:
                _read_into(f, self.offset, flat)
            else:
                buf = _chunk_buffer(self.dtype)
                for start in range(0, flat.numel(), _CHUNK):
                    n = min(_CHUNK, flat.numel() - start)
                    _read_into(f, self.offset + start * self.dtype.itemsize, buf[:n])
                    flat[start:start + n].copy_(buf[:n])
        return out if idx is Ellipsis else out[idx]


def _chunk_buffer(dtype: torch.dtype) -> torch.Tensor:
    """One buffer per reading thread and dtype, kept: a fresh one per tensor leaves freed
    holes between the parameters that the allocator does not give back (measured +15%)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    if dtype not in bufs:
        bufs[dtype] = torch.empty(_CHUNK, dtype=dtype)
    return bufs[dtype]


def _read_into(f, offset: int, t: torch.Tensor) -> None:
    view = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):   # one read returns at most ~2 GiB
        n = f.readinto(view[done:])
        if not n:
            raise RefusedError(f"{f.name}: ends inside a tensor; the file is truncated")
        done += n


def load_pretrained(folder: str | Path, built: MetaModel | None = None,
                    report: WeightReport | None = None) -> torch.nn.Module:
    """The folder's weights in an fp32 CPU model (train mode), by transformers' own loader.

    Why not `from_pretrained(folder)`: it memory-maps every shard and keeps the maps open to
    the end, so the file pages it touched count in the process (peak RSS measured 1.55x the
    fp32 parameters from bf16 files). Here the same loader (renames, fused experts, tied
    weights, buffers) gets `_Lazy` tensors instead, and the peak is the fp32 model plus the
    few tensors being read (tests/train/test_hf_models.py measures it). Whatever transformers
    reports missing, unexpected or mismatched is refused, never randomly initialised.
    `built` and `report`: the folder's `build_meta` and `check_weights`, where the caller
    already made them (the main job checks before any work), so they are not made again.
    """
    tf = require_transformers()
    if built is None:
        built = build_meta(folder)
    meta, config = built.model, copy.deepcopy(built.config)
    if report is None:
        report = check_weights(meta, folder)
    if not report.files:
        raise RefusedError(f"--model {folder}: has no safetensors weights ({SINGLE} or "
                           f"{INDEX}); nothing to load")
    cls = type(meta)
    del meta
    state = {name: _Lazy(f, *entry) for f in report.files for name, entry in _header(f).items()}
    try:
        model, info = cls.from_pretrained(
            None, config=config, state_dict=state, dtype=torch.float32,
            attn_implementation=config._attn_implementation, output_loading_info=True)
    except RuntimeError as e:   # transformers raises on mismatched or unconvertible tensors
        if "state_dict" not in str(e) and "report" not in str(e):
            raise
        raise RefusedError(f"{folder}: transformers cannot load these weights into "
                           f"{cls.__name__} ({str(e).splitlines()[0]}); {_FIX}") from None
    del state
    _refuse_mismatch(folder, report.files, {}, info.get("missing_keys"),
                     info.get("unexpected_keys"), info.get("mismatched_keys"),
                     dict(enumerate(info.get("error_msgs") or [])))
    model.config.name_or_path = str(folder)
    if (Path(folder) / "generation_config.json").is_file():
        model.generation_config = tf.GenerationConfig.from_pretrained(str(folder))
    return model.train()


# ------------------------------------------------------------------------------- saving

def save_pretrained(model: torch.nn.Module, folder: str | Path, dtype: str = "bf16",
                    tokenizer=None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF folder: config, generation config, safetensors shards + index, tokenizer.

    transformers' own `save_pretrained` writes it, so tied weights are stored once and fused
    tensors are split back to the checkpoint layout (per-expert MoE weights). "bf16" casts a
    copy of the state dict first: 2 more bytes per parameter while saving (tied tensors cast
    once); "fp32" writes the parameters as they are. Each shard is made contiguous before
    writing: up to one shard more. config.json gets the files' dtype and use_cache=true, as
    an inference user expects. `tokenizer`: a transformers tokenizer (save_pretrained), a
    megatrain tokenizer (files()) or a list of files to copy.
    """
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"dtype {dtype!r}: choose bf16 or fp32")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if dtype == "bf16":
        cast: dict[tuple, torch.Tensor] = {}
        state = {k: _cast_once(t, cast) for k, t in state.items()}
        del cast
    use_cache, model.config.use_cache = model.config.use_cache, True
    try:
        model.save_pretrained(str(folder), state_dict=state, max_shard_size=int(max_shard_bytes))
    finally:
        model.config.use_cache = use_cache
    del state
    if dtype == "bf16":   # transformers writes the live model's dtype (fp32) into config.json
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update({k: "bfloat16" for k in ("dtype", "torch_dtype") if k in cfg})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    elif tokenizer is not None:
        for p in (tokenizer.files() if hasattr(tokenizer, "files") else tokenizer):
            if Path(p).name not in ("config.json", "generation_config.json"):
                shutil.copy2(p, folder / Path(p).name)
    return folder


def _cast_once(t: torch.Tensor, seen: dict) -> torch.Tensor:
    """bf16 copy of `t`; tensors sharing storage (tied) share the copy, so transformers
    still sees them as tied and stores one."""
    if not t.is_floating_point():
        return t
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
    if key not in seen:
        seen[key] = t.detach().to(torch.bfloat16)
    return seen[key]
