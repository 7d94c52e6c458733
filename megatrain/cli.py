"""`megatrain` command line: `megatrain train ...` and `megatrain plot DIR`.

Exit status: 0 done, 1 failed while training, 2 refused before any work (bad argument or a
memory plan that does not fit; the message names the value and the fix), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

S = argparse.SUPPRESS   # options the user did not give stay out of the namespace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatrain",
                                description="Train models larger than GPU memory by streaming "
                                            "weights from host RAM.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a causal LM", argument_default=S,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train a causal LM with the megatrain torch.compile backend.\n"
                                   "With no arguments: the tiny preset on the shipped "
                                   "Shakespeare corpus.")
    g = t.add_argument_group("model and data")
    g.add_argument("--model", help="preset (tiny, 1b, 3b, 8b: megatrain's Llama) or a Hugging Face "
                                   "model folder (config.json, optional safetensors): any "
                                   "transformers causal LM, needs pip install \"megatrain[hf]\" "
                                   "[tiny]")
    g.add_argument("--data", help="text file, folder of .txt, .jsonl with a \"text\" field, "
                                  "token ids (.bin uint16/uint32, .npy), or SFT: a .jsonl of "
                                  "{\"messages\": [...]} or {\"prompt\", \"completion\"} rows "
                                  "[shipped corpus]")
    g.add_argument("--data-dtype", choices=["auto", "uint16", "uint32"],
                   help=".bin token width [auto: uint16 when the vocab fits]")
    g.add_argument("--tokenizer", help="'bytes' or a folder/file with tokenizer.json (needs the "
                                       "tokenizers package) [the model folder's own, else bytes]")
    g.add_argument("--packing", dest="packing", action="store_true",
                   help="SFT: pack several examples per row, kept apart by position ids "
                        "[on for transformers models]")
    g.add_argument("--no-packing", dest="packing", action="store_false",
                   help="SFT: one example per row, padded [megatrain's Llama presets]")
    g.add_argument("--eval-fraction", type=float,
                   help="SFT: share of the examples held out; their mean loss is logged as "
                        "eval_loss [0: no eval]")
    g.add_argument("--eval-every", type=int,
                   help="eval every N steps, 0 = only at the last [at every checkpoint save "
                        "(--save-every) and the last step]")
    g = t.add_argument_group("schedule")
    g.add_argument("--steps", type=int, help="optimizer steps [200]")
    g.add_argument("--seq", type=int, help="sequence length [256]")
    g.add_argument("--batch-tokens", type=int, help="tokens per optimizer step, all micro-batches "
                                                    "together [4096]")
    g.add_argument("--grad-accum", type=int, help="micro-batches per step [1]")
    g.add_argument("--lr", type=float, help="peak learning rate [2e-5 on pretrained weights; from "
                                                 "scratch 3e-3 below 50M params, else 3e-4]")
    g.add_argument("--warmup", type=int, help="linear warmup steps, then cosine [steps/10]")
    g.add_argument("--min-lr-ratio", type=float, help="final lr as a fraction of --lr [0.1]")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices [0.1]")
    g.add_argument("--clip", type=float, help="global gradient-norm clip, 0 = off [1.0]")
    g.add_argument("--seed", type=int, help="seed for init and data order [0]")
    g = t.add_argument_group("execution")
    g.add_argument("--device", help="compute device: cuda, cuda:N or cpu [cuda if available]")
    g.add_argument("--gpu-memory", help="device memory budget, e.g. 16GiB [backend decides]")
    g.add_argument("--host-memory", help="host RAM megatrain may add for training (optimizer "
                                         "moments, gradient slabs, offloaded activations), e.g. "
                                         "64GiB [what is available, less a margin]")
    g.add_argument("--precision", choices=["bf16", "fp32"],
                   help="compute precision; the master weights are fp32 either way "
                        "[bf16 on cuda, fp32 on cpu]")
    # Retired: the backend decides where updates run; kept only to refuse it with the reason.
    g.add_argument("--updates", help=argparse.SUPPRESS)
    g.add_argument("--compile", choices=["megatrain", "eager"],
                   help="megatrain backend, or plain torch on --device [megatrain]")
    g = t.add_argument_group("output")
    g.add_argument("--out", help="run folder: metrics.jsonl, metrics.png, checkpoints/ "
                                 "[runs/<model>]")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps, 0 = only at the "
                                                  "end [a quarter of --steps, at most 500]; "
                                                  "Ctrl-C or SIGTERM saves at the next step")
    g.add_argument("--save-dtype", help="transformers checkpoints' shards: fp32 (the exact "
                                        "weights) or bf16 (half the size; the exact fp32 "
                                        "weights kept beside them for --resume) [fp32]")
    g.add_argument("--keep", type=int, help="complete checkpoints to keep [2]")
    g.add_argument("--no-save", dest="save", action="store_false",
                   help="write no checkpoint, not even at the end (benchmarks, dry runs; a "
                        "stopped run then keeps nothing)")
    g.add_argument("--resume", action="store_true", help="continue from the latest complete "
                                                         "checkpoint in --out")
    g.add_argument("--overwrite", action="store_true", help="start over in an --out that holds "
                                                            "a run")
    g.add_argument("--stop-after", type=int, help="stop after N steps of this invocation and save "
                                                  "(the schedule still spans --steps)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")

    pl = sub.add_parser("plot", help="plot loss and throughput of a run")
    pl.add_argument("dir", help="the run's --out folder (holds metrics.jsonl)")
    pl.add_argument("-o", "--output", help="PNG path [DIR/metrics.png]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    command = args.pop("command")
    from megatrain.train import RefusedError
    from megatrain.train.interrupts import TrainingInterrupted

    try:
        if args.pop("updates", None) is not None:
            raise RefusedError("--updates is not a flag any more: megatrain decides where the "
                               "optimizer's updates run. To force it for a benchmark, set "
                               "megatrain.config.updates in the process that trains")
        if command == "plot":
            from megatrain.train.plot import plot_metrics
            print(plot_metrics(args["dir"], args.get("output")))
            return 0
        from megatrain.train.loop import train
        train(args)
        return 0
    except RefusedError as e:
        if not _quiet_rank():  # under torchrun every rank refuses alike; rank 0 says why
            print(f"megatrain {command}: refused: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        if not _quiet_rank():
            print(f"megatrain {command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the training loop (which turns signals into the below)
        print(f"megatrain {command}: interrupted before training started; earlier checkpoints, "
              f"if any, are untouched", file=sys.stderr)
        return 130
    except TrainingInterrupted as e:
        print(f"megatrain {command}: interrupted: {e}", file=sys.stderr)
        return 130


def _quiet_rank() -> bool:
    """Under torchrun, ranks other than 0 print no refusal (every rank refuses alike). They
    linger a moment before exiting: torchrun stops all ranks once one exits, and rank 0
    must first get to print why."""
    from megatrain.train.parallel import quiet_rank
    if quiet_rank():
        import time
        time.sleep(2.0)
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
