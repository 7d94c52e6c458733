"""`megatrain train`: the training command behind the CLI, in small modules with one job each.

- run_config: the arguments, merged with defaults or the resumed run's, and checked
- model_source: where the model comes from (megatrain's Llama preset, or any transformers
  causal LM folder), behind one interface the loop calls
- hf_models: transformers folders: meta build, header checks, fp32 loading, saving
- hf: Hugging Face Llama config/weight names <-> megatrain.models.Llama (presets' checkpoints)
- master_weights: the exact fp32 weights beside bf16 checkpoint shards
- tokenizer: byte-level (default), a local Hugging Face tokenizer, or the model folder's own
- data: read a corpus (text, folder, jsonl, token ids) and serve fixed-length batches
- sft: chat / prompt-completion rows -> packed or padded rows with labels
- feed: what the loop feeds the model (text windows or SFT rows) and the eval pass
- plan: host/device memory and step-time plan, checked against free host RAM
- checkpoint: atomic checkpoints (weights, optimizer, RNG, data position), verified on resume
- metrics: metrics.jsonl rows, FLOP and memory counters
- plot: loss/throughput PNG from metrics.jsonl
- loop: the training loop itself
"""


class RefusedError(ValueError):
    """The run is refused before any work: a bad argument or a plan that cannot fit.

    The message names the value and the fix. The CLI prints it and exits with status 2.
    """


__all__ = ["RefusedError"]
