"""`megatrain train --model FOLDER`: any transformers causal LM trains, checkpoints as a folder
transformers loads, fine-tunes on SFT rows with eval, resumes bit for bit, refuses bad input.

Tiny models built from configs (nothing downloaded), the CLI called in-process; plain torch
(`--compile eager`) where the backend adds nothing to what is checked, the megatrain backend
for the resume (training, the eval pass and the restored state through one compiled model).
"""

import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from _train_helpers import hf_archs, rows
from safetensors.torch import load_file, save_file

import megatrain
from megatrain.cli import main
from megatrain.train import checkpoint, loop, master_weights, model_source, sft

V = 320
ARCHS = hf_archs(V)
FAST = ["--device", "cpu", "--precision", "fp32", "--no-progress"]
EAGER = ["--compile", "eager", *FAST]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QA = [("What is two plus two?", "It is four."), ("Where did the cat sit?", "On the mat."),
      ("Say hello.", "Hello world."), ("Name a colour.", "Blue, like the sky."),
      ("What do cats say?", "Cats say meow."), ("Is water wet?", "Yes, water is wet.")]


def _folder(path, arch="llama", seed=0, weights=True, template=None, **over):
    """A model folder as transformers writes one; with a tokenizer (vocab V) when `template`
    is given (a chat template, or "" for none)."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(arch, **{**ARCHS[arch], **over})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if weights:
        model.save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    if template is not None:
        _tokenizer(path, template)
    return path


def _tokenizer(folder, template):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    corpus = [f"user assistant system {q} {a}" for q, a in QA] * 4
    tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=V, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    assert len(fast) <= V
    if template:
        fast.chat_template = template
    fast.save_pretrained(folder)


def _chats(path, n=24):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": QA[i % len(QA)][0]},
        {"role": "assistant", "content": QA[i % len(QA)][1]}]}) + "\n" for i in range(n)))
    return path


class _Keep:
    """Records the model each run builds (the loop trains that very object)."""

    def __init__(self, monkeypatch):
        self.models = []
        build = model_source.TransformersModel.build

        def keep(source):
            self.models.append(build(source))
            return self.models[-1]
        monkeypatch.setattr(model_source.TransformersModel, "build", keep)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architectures_train_and_reload_in_transformers(tmp_path, monkeypatch, arch):
    """20 steps from the folder's weights through the megatrain backend, the loss falls; the
    checkpoint is a folder that transformers loads with the trained model's logits. (The
    scheduled graphs run as they are, lowering "eager": the zoo tests Inductor's code.)"""
    monkeypatch.setattr(megatrain.config, "lowering", "eager")
    kept = _Keep(monkeypatch)
    src, out = _folder(tmp_path / "m", arch), tmp_path / "run"
    assert main(["train", "--compile", "megatrain", *FAST, "--model", str(src), "--seq", "16",
                 "--batch-tokens", "64",
                 "--steps", "20", "--lr", "1e-2", "--out", str(out)]) == 0
    losses = [r["loss"] for r in rows(out)]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    ckpt = checkpoint.latest_checkpoint(out)
    assert json.loads((ckpt / "state.json").read_text())["weights"] == "transformers"
    assert checkpoint.verify_checkpoint(ckpt) is None
    back = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert type(back).__name__ == type(kept.models[0]).__name__
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(ids).logits, kept.models[0].eval()(ids).logits,
                                   rtol=0, atol=0)


def test_moe_through_the_megatrain_backend_trains_like_eager(tmp_path, monkeypatch):
    """A mixture of experts (routed, top-2 of 4) through `backend="megatrain"`: the losses
    and the saved weights are eager's. The scheduled graphs run as they are (lowering
    "eager": Inductor's code for them is the zoo's to test, tests/compiler/test_hf_zoo.py)."""
    monkeypatch.setattr(megatrain.config, "lowering", "eager")
    try:
        loop.resolve_backend()
    except loop.RefusedError:
        pytest.skip("the megatrain backend is not importable")
    src = _folder(tmp_path / "m", "qwen3_moe")
    for compile_ in ("eager", "megatrain"):
        assert main(["train", "--compile", compile_, *FAST, "--model", str(src), "--seq", "16",
                     "--batch-tokens", "64", "--steps", "8", "--lr", "1e-2",
                     "--out", str(tmp_path / compile_)]) == 0
    le, lm = ([r["loss"] for r in rows(tmp_path / c)] for c in ("eager", "megatrain"))
    assert lm == pytest.approx(le, rel=1e-4) and sum(lm[-3:]) / 3 < lm[0] - 0.5, (le, lm)
    we, wm = (load_file(str(checkpoint.latest_checkpoint(tmp_path / c) / "model.safetensors"))
              for c in ("eager", "megatrain"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in wm        # the checkpoint layout
    for k in we:
        torch.testing.assert_close(wm[k], we[k], rtol=1e-3, atol=1e-4)


def test_sft_with_the_folder_tokenizer_reports_eval_loss(tmp_path, capsys):
    """Chat rows rendered by the folder's own tokenizer (its chat template), packed; a held-out
    share is evaluated at --eval-every and at the end, and the last eval_loss is the mean loss
    per trained token of the held-out rows under the saved weights."""
    src = _folder(tmp_path / "m", template=CHATML)
    data, out = _chats(tmp_path / "chat.jsonl"), tmp_path / "run"
    assert main(["train", *EAGER, "--model", str(src), "--data", str(data), "--seq", "64",
                 "--batch-tokens", "128", "--steps", "8", "--lr", "1e-2", "--eval-fraction", "0.25",
                 "--eval-every", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "SFT data" in err and "18 chat examples in 9 rows" in err and "(packed)" in err, err
    assert "0 examples longer than --seq were truncated" in err and "6 examples held out" in err
    evals = [r for r in rows(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    ckpt = checkpoint.latest_checkpoint(out)
    assert transformers.AutoTokenizer.from_pretrained(ckpt).chat_template == CHATML  # saved with it
    assert evals[1]["eval_loss"] == pytest.approx(_held_out_loss(ckpt, data), rel=1e-5)
    assert (out / "metrics.png").is_file()


def _held_out_loss(ckpt, data, master=False) -> float:
    """The mean loss per trained token of the held-out rows (--eval-fraction 0.25, seed 0,
    --seq 64: two examples a row), computed here by transformers from the checkpoint."""
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    _, held = sft.build_sft(data, tok, 64, eval_fraction=0.25, seed=0)
    assert len(held) < held.examples                                 # packed
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if master:
        master_weights.load(model, ckpt / master_weights.FILENAME)
    ids, labels, pos = held.rows(slice(None))
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                   labels[:, 1:].flatten()))


def test_sft_on_a_preset_pads_each_example(tmp_path, capsys):
    """megatrain's own Llama has no position ids: SFT rows are padded one per row, said once;
    prompt/completion rows work with the byte tokenizer."""
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "completion": " " + a}) + "\n" for q, a in QA))
    out = tmp_path / "run"
    assert main(["train", *EAGER, "--data", str(data), "--seq", "64", "--batch-tokens", "128",
                 "--steps", "3", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "6 prompt_completion examples in 6 rows" in err and "padded to a row of its own" in err
    assert json.loads((checkpoint.latest_checkpoint(out) / "state.json").read_text())[
        "config"]["packing"] is False


@pytest.mark.parametrize("how", ["megatrain-sft-bf16", "eager-text-fp32"])
def test_resume_is_bit_exact(tmp_path, how, monkeypatch):
    """Interrupted after step 2 and resumed: the same losses, eval losses and final weights as
    one uninterrupted run, with the model folder gone. With --save-dtype bf16 the shards are
    bf16 and the resume reads the fp32 master beside them. (The backend's graphs run as
    scheduled, lowering "eager": the preset's resume test covers Inductor's.)"""
    monkeypatch.setattr(megatrain.config, "lowering", "eager")
    compile_, data, dtype = how.split("-")
    if compile_ == "megatrain":
        try:
            loop.resolve_backend()
        except loop.RefusedError:
            pytest.skip("the megatrain backend is not importable")
    src = _folder(tmp_path / "m", template=CHATML, tie_word_embeddings=True)
    common = ["train", "--compile", compile_, *FAST, "--model", str(src), "--seq", "64",
              "--batch-tokens", "128", "--steps", "4", "--save-every", "2", "--lr", "1e-2",
              "--save-dtype", dtype]
    if data == "sft":
        common += ["--data", str(_chats(tmp_path / "chat.jsonl")), "--eval-fraction", "0.25"]
    else:
        text = tmp_path / "t.txt"
        text.write_text(" ".join(q + " " + a for q, a in QA) * 20)
        common += ["--data", str(text)]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([*common, "--out", str(a)]) == 0
    assert main([*common, "--out", str(b), "--stop-after", "2"]) == 0
    src.rename(tmp_path / "moved")   # the resume reads the checkpoint alone (and its tokenizer)
    assert main([*common[:1], "--resume", "--out", str(b), *FAST[-1:]]) == 0
    def trace(out):
        return [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("grad_norm")) for r in rows(out)]
    assert trace(a) == trace(b)                                        # bit for bit
    ca, cb = checkpoint.latest_checkpoint(a), checkpoint.latest_checkpoint(b)
    if data == "sft":   # eval through the compiled model, as transformers computes it
        evals = [r for r in rows(b) if "eval_loss" in r]
        assert [r["step"] for r in evals] == [2, 4]
        assert evals[-1]["eval_loss"] == pytest.approx(
            _held_out_loss(cb, tmp_path / "chat.jsonl", master=dtype == "bf16"), rel=1e-5)
    for name in ("model.safetensors", "master.safetensors") if dtype == "bf16" else ("model.safetensors",):
        wa, wb = load_file(str(ca / name)), load_file(str(cb / name))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), name
    shards = load_file(str(cb / "model.safetensors"))
    assert {t.dtype for t in shards.values()} == {torch.bfloat16 if dtype == "bf16" else torch.float32}
    assert json.loads((cb / "config.json").read_text())["dtype"] == (
        "bfloat16" if dtype == "bf16" else "float32")
    # verify_checkpoint reads the transformers layout: a tensor gone from the shards is named
    assert checkpoint.verify_checkpoint(cb) is None
    f = cb / ("master.safetensors" if dtype == "bf16" else "model.safetensors")
    tensors = load_file(str(f))
    gone = max(tensors)
    del tensors[gone]
    save_file(tensors, str(f), metadata={"format": "pt"})
    manifest = json.loads((cb / checkpoint.MANIFEST).read_text())   # sizes agree: names tell
    manifest["files"][f.name]["bytes"] = f.stat().st_size
    (cb / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    reason = checkpoint.verify_checkpoint(cb, checksums=False)
    assert reason is not None and gone.split(".")[-2] in reason, reason


# ------------------------------------------------------------------------------ refusals

def _refused(capsys, *args) -> str:
    assert main(["train", *EAGER, "--steps", "2", *args]) == 2
    return capsys.readouterr().err


def test_refusals_name_the_value_before_any_work(tmp_path, capsys, monkeypatch):
    src = _folder(tmp_path / "m", template="")           # a tokenizer without a chat template
    chat, text = _chats(tmp_path / "chat.jsonl", 4), tmp_path / "t.txt"
    text.write_text("some plain text to train on " * 40)
    out = tmp_path / "run"
    m = ["--model", str(src), "--out", str(out), "--seq", "16", "--batch-tokens", "32"]
    for args, needle in [
        ([*m, "--eval-fraction", "1.5"], "--eval-fraction 1.5: must be at least 0 and below 1"),
        ([*m, "--save-dtype", "fp8"], "--save-dtype fp8: choose fp32"),
        ([*m, "--data", str(chat)], "has no chat template"),
        ([*m, "--data", str(text), "--no-packing"], "--no-packing: packing applies to SFT data"),
        ([*m, "--data", str(text), "--eval-fraction", "0.1"], "--eval-fraction 0.1: eval holds out"),
        ([*m, "--eval-every", "5"], "--eval-every 5: there is no eval set"),
        (["--data", str(chat), "--tokenizer", str(src), "--packing", "--out", str(out)],
         "--packing: megatrain's own Llama has no position ids"),
        (["--save-dtype", "bf16", "--out", str(out)], "--save-dtype bf16: megatrain's own Llama"),
    ]:
        err = _refused(capsys, *args)
        assert needle in err and "Traceback" not in err, (needle, err)
        assert not out.exists(), args                     # refused before anything was written
    # weights that do not match config.json: refused from the headers, naming the tensor
    bad = _folder(tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    err = _refused(capsys, *m[2:], "--model", str(bad))
    assert "model.norm.weight" in err and "shape (31,)" in err and not out.exists(), err
    # without transformers a model folder is refused with the install line
    monkeypatch.setitem(sys.modules, "transformers", None)
    err = _refused(capsys, *m)
    assert f"--model {src}: " in err and 'pip install "megatrain[hf]"' in err, err
    assert not out.exists()


def test_master_weights_round_trip_tied(tmp_path):
    """The fp32 master beside bf16 shards: tied tensors once, loaded exactly, checked from
    the header (a meta model is enough)."""
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen2", **ARCHS["qwen2"]))
    master_weights.save(model, tmp_path)
    names = set(load_file(str(tmp_path / master_weights.FILENAME)))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    other = transformers.AutoModelForCausalLM.from_config(model.config)
    master_weights.load(other, tmp_path / master_weights.FILENAME)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))
    assert other.lm_head.weight is other.model.embed_tokens.weight
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(model.config)
    master_weights.check(meta, tmp_path / master_weights.FILENAME)
