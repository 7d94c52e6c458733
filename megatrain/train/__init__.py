"""`megatrain train`: the training command behind the CLI, in small modules with one job each.

- tokenizer: byte-level (default) or a local Hugging Face tokenizer
- data: read a corpus (text, folder, jsonl, token ids) and serve fixed-length batches
- hf: Hugging Face Llama config/weight names <-> megatrain.models.Llama
- plan: host/device memory and step-time plan, checked against free host RAM
- checkpoint: atomic checkpoints (safetensors weights, optimizer, RNG, data position)
- metrics: metrics.jsonl rows, FLOP and memory counters
- plot: loss/throughput PNG from metrics.jsonl
- loop: the training loop itself
"""


class RefusedError(ValueError):
    """The run is refused before any work: a bad argument or a plan that cannot fit.

    The message names the value and the fix. The CLI prints it and exits with status 2.
    """


__all__ = ["RefusedError"]
