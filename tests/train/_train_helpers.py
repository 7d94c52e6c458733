"""Helpers shared by tests/train (imported by name: pytest puts this folder on sys.path)."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from megatrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
# Small and fast: the tiny preset on short sequences, plain torch on the CPU, fp32.
_SUBPROCESS_CACHE = tempfile.mkdtemp(prefix="megatrain-cli-cache-")
SMALL = ["--compile", "eager", "--device", "cpu", "--precision", "fp32", "--seq", "32",
         "--batch-tokens", "128", "--no-progress"]


def hf_archs(vocab: int) -> dict[str, dict]:
    """Config kwargs of tiny transformers causal LMs, one per architecture the main job is
    tested on (`AutoConfig.for_model(arch, **kwargs)`): Llama, Qwen2 with tied embeddings,
    Mistral, Gemma2 (soft-capped), Phi3 (fused QKV) and Qwen3-MoE (routed experts)."""
    common = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    return {
        "llama": dict(common),
        "qwen2": dict(common, tie_word_embeddings=True),
        "mistral": dict(common),
        "gemma2": dict(common, head_dim=8),
        "phi3": dict(common, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "qwen3_moe": dict(common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          head_dim=8),
    }


def train(*args: str) -> int:
    return main(["train", *SMALL, *args])


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def python_env() -> dict:
    """The environment of a CLI run in its own process: as a user's (it probes the machine
    at its first compile), with a cache folder of its own so its rates never reach the
    plans of the tests that run in this process."""
    env = dict(os.environ)
    env["MEGATRAIN_CACHE"] = _SUBPROCESS_CACHE
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_module(*args: str, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain", *args], cwd=cwd, env=env or python_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_modules(*commands: list[str], timeout=300) -> list[subprocess.CompletedProcess]:
    """`run_module` for independent commands, all at once; their results in order. Output
    goes to files, not pipes, so no process stalls on a full pipe while another is read."""
    with contextlib.ExitStack() as stack:
        files = [(stack.enter_context(tempfile.TemporaryFile("w+")),
                  stack.enter_context(tempfile.TemporaryFile("w+"))) for _ in commands]
        procs = [subprocess.Popen([sys.executable, "-m", "megatrain", *args], env=python_env(),
                                  stdout=out, stderr=err, text=True)
                 for args, (out, err) in zip(commands, files)]
        try:
            for proc in procs:
                proc.wait(timeout=timeout)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        done = []
        for proc, (out, err) in zip(procs, files):
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
        return done
