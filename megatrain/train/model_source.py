"""Where the trained model comes from, behind the one interface the loop calls.

Two kinds, one class each:

- `MegatrainLlama`: a preset (`--model tiny|1b|3b|8b`), or the resume of a run saved in the
  Llama layout (hf.py's names; every checkpoint before `weights` was recorded in state.json).
  megatrain's own Llama: `forward(input_ids, labels)` with labels already shifted (the
  target of each position), no position ids, one causal mask over the whole row.
- `TransformersModel`: any folder with a config.json that transformers builds as a causal LM
  (Llama folders included), or the resume of such a run (its checkpoint is such a folder).
  The forward is transformers': `model(input_ids=, labels=, position_ids=).loss`, labels
  unshifted (the model shifts them inside its loss).

The loop asks, in order: `vocab_size`/`max_seq` and `meta()` for the checks and the memory
plan; `check()` before any work (weights' headers against the model: a bad folder is refused
while nothing is written); `build()` after it (the starting weights: pretrained, the
checkpoint's, or a seeded random init); `loss()` per micro-batch; `save()` into a checkpoint
folder; `state()` for state.json, which tells a resume which class reads the checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from megatrain.models import PRESETS, Llama, LlamaConfig

from . import RefusedError, checkpoint, hf, hf_models, master_weights, plan

LLAMA = "megatrain-llama"
TRANSFORMERS = "transformers"


def resolve(model: str, ckpt: Path | None) -> MegatrainLlama | TransformersModel:
    """The source for `--model` (a preset or a folder), or for the checkpoint resumed."""
    if ckpt is not None:
        state = checkpoint.read_state(ckpt)
        if state.get("weights") == TRANSFORMERS:
            return TransformersModel(ckpt, save_dtype=state.get("save_dtype", "fp32"))
        raw = hf.read_config(ckpt)     # no "weights": saved before it was recorded, a Llama
        return MegatrainLlama(hf.llama_config_from_hf(raw, str(ckpt / "config.json")),
                              Path(model).name if model not in PRESETS else model,
                              hf_base=raw, files=hf.weight_files(ckpt))
    if model in PRESETS:
        return MegatrainLlama(dataclasses.replace(PRESETS[model]), model)
    path = Path(model)
    if hf.is_hf_folder(path):
        try:
            hf_models.require_transformers()
        except RefusedError as e:
            raise RefusedError(f"--model {model}: {e}") from None
        return TransformersModel(path)
    if path.is_dir():
        raise RefusedError(f"--model {model}: the folder has no config.json; point at a "
                           f"Hugging Face model folder or use a preset ({', '.join(PRESETS)})")
    raise RefusedError(f"--model {model}: neither a preset ({', '.join(PRESETS)}) nor a "
                       f"folder with a Hugging Face config.json")


class MegatrainLlama:
    """megatrain.models.Llama from a LlamaConfig; weights from `files` (hf.py's names) or
    a random init."""

    kind = LLAMA
    packs = False   # no position ids: packed examples would attend to each other
    no_packing = "megatrain's own Llama has no position ids and one causal mask per row"

    def __init__(self, lcfg: LlamaConfig, name: str, hf_base: dict | None = None,
                 files: list[Path] = ()):
        self.lcfg, self.name, self.hf_base, self.files = lcfg, name, hf_base, list(files)
        self.vocab_size, self.max_seq = lcfg.vocab_size, lcfg.max_seq
        self.pretrained = bool(self.files)
        self.notes: list[str] = []
        self._meta = None

    def meta(self) -> nn.Module:
        if self._meta is None:
            with torch.device("meta"):
                self._meta = Llama(self.lcfg)
        return self._meta

    def check(self) -> str | None:
        if self.files:
            hf.load_weights(self.meta(), self.files, check_only=True)
        return None

    def build(self) -> nn.Module:
        model = Llama(self.lcfg)
        if self.files:
            hf.load_weights(model, self.files)
        return model

    def loss(self, step_fn, batch) -> torch.Tensor:
        return step_fn(batch.input_ids, labels=batch.targets)

    def flops_per_token(self, model: nn.Module, seq: int) -> float:
        return plan.model_flops_per_token(model, seq)

    def save(self, model: nn.Module, folder: Path, tok, save_dtype: str) -> None:
        hf.save_weights(model, folder)
        (folder / "config.json").write_text(
            json.dumps(hf.hf_config_from_llama(self.lcfg, self.hf_base), indent=2))
        _save_tokenizer(tok, folder)

    def state(self, save_dtype: str) -> dict:
        return {"weights": self.kind, "model_config": asdict(self.lcfg)}

    def saved_bytes_per_param(self, save_dtype: str) -> int:
        return 4   # fp32 weights, which --resume reads


class TransformersModel:
    """A transformers causal LM built from a folder (hf_models): its safetensors when there
    are any (checked from the headers, read shard by shard as fp32), else transformers'
    random init under the run's seed. A resumed `--save-dtype bf16` checkpoint also holds
    the exact fp32 weights (master_weights), read over the bf16 shards."""

    kind = TRANSFORMERS

    def __init__(self, folder: Path, save_dtype: str = "fp32"):
        self.folder = Path(folder)
        self.built = hf_models.build_meta(folder)       # refuses without transformers
        self.config, self.notes = self.built.config, list(self.built.notes)
        dims = hf_models.model_dims(self.config)
        self.vocab_size, self.max_seq = dims["vocab_size"], dims["max_seq"]
        self.name = self.folder.name
        self.master = save_dtype == "bf16"
        self.files: list[Path] = []
        self._report: hf_models.WeightReport | None = None   # check()'s, reused by build()
        self.pretrained = False
        # position ids restarting per example make transformers mask across packed examples
        forward = inspect.signature(type(self.built.model).forward).parameters
        self.packs = "position_ids" in forward
        self.no_packing = f"{type(self.built.model).__name__}.forward takes no position_ids"

    def meta(self) -> nn.Module:
        return self.built.model

    def check(self) -> str:
        """The weights against the model, from the file headers; a line for the log."""
        report = self._report = hf_models.check_weights(self.built.model, self.folder)
        if self.master:
            master_weights.check(self.built.model, self.folder / master_weights.FILENAME)
        self.files, self.pretrained = report.files, bool(report.files)
        if not report.files:
            return f"weights: {self.folder} has none: random init (transformers', seeded by --seed)"
        dtypes = ", ".join(f"{n} {d}" for d, n in sorted(report.dtypes.items()))
        exact = " (exact fp32 from master.safetensors)" if self.master else ""
        return (f"weights: {report.tensors} tensors ({dtypes}) in {len(report.files)} file(s) "
                f"of {self.folder}, read as fp32{exact}")

    def build(self) -> nn.Module:
        if self.files:
            model = hf_models.load_pretrained(self.folder, self.built, self._report)
        else:
            model = hf_models.build_model(self.config)
        if self.master:
            master_weights.load(model, self.folder / master_weights.FILENAME)
        return model.train()

    def loss(self, step_fn, batch) -> torch.Tensor:
        # without position_ids (not packed) every row's positions are 0..seq-1, the default
        kwargs = {"position_ids": batch.position_ids} if self.packs and \
            batch.position_ids is not None else {}
        return step_fn(input_ids=batch.input_ids, labels=batch.labels, **kwargs).loss

    def flops_per_token(self, model: nn.Module, seq: int) -> float:
        return moe_flops_per_token(model, seq)

    def save(self, model: nn.Module, folder: Path, tok, save_dtype: str) -> None:
        logs = hf_models.require_transformers().utils.logging
        bar = logs.is_progress_bar_enabled()
        logs.disable_progress_bar()   # a bar per checkpoint would break the run's own bar
        try:
            hf_models.save_pretrained(model, folder, dtype=save_dtype, tokenizer=tok)
        finally:
            if bar:
                logs.enable_progress_bar()
        if save_dtype == "bf16":
            master_weights.save(model, folder)

    def saved_bytes_per_param(self, save_dtype: str) -> int:
        return 4 if save_dtype == "fp32" else 2 + 4   # bf16 shards and the fp32 master beside

    def state(self, save_dtype: str) -> dict:
        return {"weights": self.kind, "save_dtype": save_dtype,
                "model_config": {"model_type": getattr(self.config, "model_type", None),
                                 "architectures": getattr(self.config, "architectures", None)}}


def _save_tokenizer(tok, folder: Path) -> None:
    """The run's tokenizer beside the weights, so the folder is self-contained."""
    if hasattr(tok, "save_pretrained"):
        tok.save_pretrained(folder)
        return
    import shutil
    for f in tok.files():
        shutil.copy2(f, folder / Path(f).name)


def moe_flops_per_token(model: nn.Module, seq: int) -> float:
    """plan.model_flops_per_token with a mixture of experts counted by what a token uses.

    Approximate: each token is taken to run `num_experts_per_tok` of `num_experts` experts,
    so expert weights count by that share; whether experts are fused 3-D parameters (as
    transformers 5 keeps them) or Linear modules under an `experts` list; routers and shared
    experts count in full. Router, softmax and top-k FLOPs are left out."""
    dense = plan.model_flops_per_token(model, seq)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "num_selected_experts", None)
    if not top_k:
        return dense
    correction, seen = 0.0, set()
    for name, module in model.named_modules():
        if not name.endswith("experts"):
            continue
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        fused = [p for p in params if p.ndim >= 3]
        linear = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
        n_experts = fused[0].shape[0] if fused else max(1, len(list(module.children())))
        share = min(1.0, top_k / n_experts)
        correction += 6.0 * sum(p.numel() for p in fused) * share   # not Linear: not counted yet
        correction -= 6.0 * linear * (1 - share)                    # Linear: counted in full
    return dense + correction
