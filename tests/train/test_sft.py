"""SFT data: labels only on what the model should write, packed examples stay apart, refusals.

A small byte-level BPE tokenizer with a ChatML template is built here (nothing downloaded), saved
and re-loaded through AutoTokenizer, as the CLI would load a real one."""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatrain.train import RefusedError, sft

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
END = "<|im_end|>\n"
CORPUS = ["What is two plus two? It is four.", "The cat sat on the mat, said the user.",
          "hello world: a system prompt for a helpful assistant"] * 4


def _save_tokenizer(folder, template):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=320, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]))
    # tokenizer(prompt) adds bos, so the prompt's special tokens are exercised
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    if template:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return _save_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    return _save_tokenizer(tmp_path_factory.mktemp("plain"), None)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _chat(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return {"messages": [{"role": roles[t[0]], "content": t[2:]} for t in turns]}


PC = {"prompt": "What is two plus two?", "completion": " It is four."}
CHAT2 = _chat("s:a system prompt", "u:What is two plus two?", "a:It is four.",
              "u:The cat sat?", "a:On the mat, said the cat.")


def _model(vocab, seq):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).float()


def test_prompt_completion_labels(tmp_path, tok):
    train, held = sft.build_sft(_jsonl(tmp_path / "d.jsonl", [PC]), tok, 32, packing=False)
    assert held is None
    p = tok(PC["prompt"])["input_ids"]
    c = tok(PC["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert p[0] == tok.bos_token_id and len(p) > 2
    ids, labels, pos = (t[0].tolist() for t in train.rows(slice(0, 1)))
    n = len(p) + len(c)
    assert ids[:n] == p + c and ids[n:] == [tok.pad_token_id] * (32 - n)
    assert labels[:len(p)] == [-100] * len(p)
    assert labels[len(p):n] == c and labels[n:] == [-100] * (32 - n)
    assert pos == list(range(32))
    assert train.summary() == {"format": "prompt_completion", "examples": 1, "rows": 1, "seq": 32,
                               "tokens": n, "trained_tokens": len(c), "truncated": 0,
                               "truncated_no_loss": 0}


def test_chat_labels_only_assistant_turns(tok):
    ids, labels = sft.encode_chat(CHAT2["messages"], tok)
    # contiguous labelled runs, decoded, are exactly the assistant turns with their end marker
    on = labels != -100
    assert np.array_equal(labels[on], ids[on])
    edges = np.flatnonzero(np.diff(np.concatenate([[0], on.astype(int), [0]])))
    spans = [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert spans == ["It is four." + END, "On the mat, said the cat." + END]
    # everything else (system, user, role headers) carries no label
    rest = tok.decode(ids[~on].tolist())
    assert rest == ("<|im_start|>system\na system prompt" + END + "<|im_start|>user\nWhat is two "
                    "plus two?" + END + "<|im_start|>assistant\n<|im_start|>user\nThe cat sat?" + END
                    + "<|im_start|>assistant\n")
    # a chat ending on a user turn: the trailing user tokens are unlabelled too
    ids3, labels3 = sft.encode_chat(CHAT2["messages"] + [{"role": "user", "content": "ok"}], tok)
    assert np.array_equal(ids3[:len(ids)], ids) and np.array_equal(labels3[:len(ids)], labels)
    assert (labels3[len(ids):] == -100).all()


def test_packing_layout(tmp_path, tok):
    rows = [PC, CHAT2, {"prompt": "The cat", "completion": " sat on the mat."}, _chat("u:hi", "a:hello")]
    train, _ = sft.build_sft(_jsonl(tmp_path / "d.jsonl", rows), tok, 64)
    examples = [sft.encode_prompt_completion(PC["prompt"], PC["completion"], tok),
                sft.encode_chat(CHAT2["messages"], tok),
                sft.encode_prompt_completion("The cat", " sat on the mat.", tok),
                sft.encode_chat(rows[3]["messages"], tok)]
    assert all(len(e[0]) <= 64 for e in examples) and sum(len(e[0]) for e in examples) > 64
    assert len(train) >= 2 and train.summary()["format"] == "mixed"
    found = []
    for r in range(len(train)):
        ids, lab, pos = train.input_ids[r], train.labels[r], train.position_ids[r]
        starts = np.flatnonzero(pos == 0)
        assert starts[0] == 0
        for k, a in enumerate(starts):
            b = starts[k + 1] if k + 1 < len(starts) else 64
            e = next(i for i, (x, _) in enumerate(examples)
                     if len(x) <= b - a and np.array_equal(ids[a:a + len(x)], x))
            n = len(examples[e][0])
            assert lab[a] == -100  # never predicted from the previous example
            assert np.array_equal(lab[a + 1:a + n], examples[e][1][1:])
            assert np.array_equal(pos[a:b], np.arange(b - a))  # the pad tail continues the last one
            assert (ids[a + n:b] == tok.pad_token_id).all() and (lab[a + n:b] == -100).all()
            found.append(e)
    assert sorted(found) == [0, 1, 2, 3]
    assert train.tokens == sum(len(e[0]) for e in examples)
    assert train.summary()["trained_tokens"] == sum(int((e[1][1:] != -100).sum()) for e in examples)
    assert train.in_memory_bytes() == 3 * 4 * len(train) * 64


def test_first_label_of_each_packed_example_is_ignored():
    # fully labelled examples (as a chat that opens on a labelled token would be): the token
    # before an example belongs to another one and must not learn to predict it
    ex = [(np.arange(10, 10 + n), np.arange(10, 10 + n)) for n in (5, 4, 3, 6)]
    for packing, n_rows in ((True, 2), (False, 4)):
        d = sft.pack_examples(ex, 9, pad_id=0, packing=packing)
        assert len(d) == n_rows and d.tokens == 18 and d.summary()["trained_tokens"] == 14
        starts = d.position_ids == 0
        assert (d.labels[starts] == -100).all()
        real = (d.input_ids != 0) & ~starts
        assert np.array_equal(d.labels[real], d.input_ids[real])


def test_truncation_is_counted(tmp_path, tok):
    long = {"prompt": "the cat", "completion": " It is four. " * 8}
    path = _jsonl(tmp_path / "d.jsonl", [PC, long, {"prompt": "hello world " * 20, "completion": "hi"}])
    train, _ = sft.build_sft(path, tok, 24)
    s = train.summary()
    assert s["examples"] == 3 and s["truncated"] == 2 and s["truncated_no_loss"] == 1
    assert train.input_ids.shape[1] == 24
    # the prompt cut before its completion is dropped: every row trains some token
    assert ((train.labels != -100).sum(axis=1) > 0).all()
    hello = tok("hello world " * 20)["input_ids"][:24]
    assert not any(np.array_equal(train.input_ids[r, :24], hello) for r in range(len(train)))
    long_ids, long_lab = sft.encode_prompt_completion(long["prompt"], long["completion"], tok)
    assert len(long_ids) > 24
    row = [r for r in range(len(train)) if np.array_equal(train.input_ids[r], long_ids[:24])]
    assert len(row) == 1
    assert np.array_equal(train.labels[row[0], 1:], long_lab[1:24])
    assert np.array_equal(train.position_ids[row[0]], np.arange(24))


def test_eval_split(tmp_path, tok):
    rows = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(20)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    train, held = sft.build_sft(path, tok, 16, packing=False, eval_fraction=0.25, seed=3)
    assert (train.examples, held.examples, len(held)) == (15, 5, 5)
    tr, ev = sft.split_indices(20, 0.25, seed=3)
    assert sorted(np.concatenate([tr, ev]).tolist()) == list(range(20))
    expect = [sft.encode_prompt_completion(rows[i]["prompt"], rows[i]["completion"], tok)[0]
              for i in ev]
    assert [held.input_ids[r, :len(e)].tolist() for r, e in enumerate(expect)] == [e.tolist() for e in expect]
    assert np.array_equal(sft.split_indices(20, 0.25, 3)[1], ev)
    assert not np.array_equal(sft.split_indices(20, 0.25, 4)[1], ev)
    assert len(sft.split_indices(20, 0.01, 0)[1]) == 1  # at least one held out
    assert len(sft.split_indices(20, 0.0, 0)[1]) == 0
    for f, n in ((0.5, 1), (0.98, 20)):
        with pytest.raises(RefusedError, match=f"--eval-fraction {f}: .*none for training"):
            sft.split_indices(n, f, 0)
    with pytest.raises(RefusedError, match="--eval-fraction 1"):
        sft.split_indices(20, 1, 0)


def test_batches_resume_and_ranks(tmp_path, tok):
    rows = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(7)]
    train, _ = sft.build_sft(_jsonl(tmp_path / "d.jsonl", rows), tok, 12, packing=False)
    a = sft.SFTBatches(train, batch=2, seed=5)
    seen = [a.next_batch()[0] for _ in range(5)]  # crosses into epoch 1
    assert all(t.dtype == torch.int64 and t.shape == (2, 12) for t in a.next_batch())
    first_epoch = torch.cat(seen)[:7]
    assert sorted(first_epoch[:, 1:4].tolist()) == sorted(train.input_ids[:, 1:4].tolist())
    state = a.state_dict()
    expect = a.next_batch()
    b = sft.SFTBatches(train, batch=2, seed=5)
    b.load_state_dict(json.loads(json.dumps(state)))  # plain integers survive a JSON round trip
    assert all(torch.equal(x, y) for x, y in zip(b.next_batch(), expect))
    other = sft.SFTBatches(train, batch=2, seed=6)
    assert not all(torch.equal(other.next_batch()[0], s) for s in seen[:1])
    with pytest.raises(RefusedError, match="seed=5, this run has 6"):
        other.load_state_dict(state)
    whole = sft.SFTBatches(train, batch=4, seed=1).next_batch()
    halves = [sft.SFTBatches(train, batch=4, seed=1, rank=r, world=2).next_batch() for r in (0, 1)]
    assert all(torch.equal(torch.cat([h[i] for h in halves]), whole[i]) for i in range(3))


def test_refusals(tmp_path, tok, plain_tok):
    def refused(rows, match, t=tok, name="d.jsonl"):
        path = _jsonl(tmp_path / name, rows) if rows is not None else tmp_path / name
        with pytest.raises(RefusedError, match=match):
            sft.build_sft(path, t, 32)

    refused([PC, PC, '{"prompt": "x", '], r"d\.jsonl: line 3 is not JSON")
    refused([PC, {"question": "x", "answer": "y"}], r"line 2 has neither \"messages\" nor .*question")
    refused([{"text": "plain"}], r"line 1 is a \{\"text\": ...\} row, which is pretraining")
    refused([PC, _chat("s:sys", "u:hi")], r"line 2: the chat has no \"assistant\" turn")
    refused([{"prompt": "x", "completion": 3}], r"line 1: \"completion\" is int")
    refused([{"messages": [{"role": "user"}]}], r"line 1: message 0 .* is not")
    refused([CHAT2], r"line 1: the tokenizer .* has no chat template.*prompt/completion rows", plain_tok)
    (tmp_path / "e.jsonl").write_text("\n\n")
    refused(None, r"e\.jsonl: the file is empty", name="e.jsonl")
    (tmp_path / "b.jsonl").write_bytes(json.dumps(PC).encode() + b'\n{"prompt": "\xff"}\n')
    refused(None, r"b\.jsonl: line 2 is not UTF-8", name="b.jsonl")
    refused(None, r"no such file", name="missing/d.jsonl")
    # a template that rewrites earlier turns once later ones follow cannot be split into turns
    shifty = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    shifty.chat_template = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n"
                            "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    refused([CHAT2], r"line 1: the chat template renders assistant turn 2 differently", shifty)
    # pretraining text is not SFT; the CLI's router says so without reading the file
    assert sft.is_sft_jsonl(_jsonl(tmp_path / "c.jsonl", ["", CHAT2]))
    assert sft.is_sft_jsonl(_jsonl(tmp_path / "p.jsonl", [PC]))
    assert not sft.is_sft_jsonl(_jsonl(tmp_path / "t.jsonl", [{"text": "a"}]))
    assert not sft.is_sft_jsonl(_jsonl(tmp_path / "x.jsonl", ["not json"]))
    assert not sft.is_sft_jsonl(tmp_path / "nothing.jsonl")


def test_prompt_tokens_contribute_no_gradient(tmp_path, tok):
    seq = 32
    train, _ = sft.build_sft(_jsonl(tmp_path / "d.jsonl", [PC]), tok, seq, packing=False)
    ids, labels, pos = train.rows(slice(0, 1))
    model = _model(len(tok), seq)
    n_p = len(tok(PC["prompt"])["input_ids"])
    n_c = len(tok(PC["completion"], add_special_tokens=False)["input_ids"]) + 1  # + eos

    model.zero_grad()
    out = model(ids, labels=labels, position_ids=pos)
    out.loss.backward()
    grad_model = model.lm_head.weight.grad.clone()

    # by hand: only completion (+eos) tokens are targets, each predicted from the position before
    model.zero_grad()
    logits = model(ids, position_ids=pos).logits.float()
    hand = F.cross_entropy(logits[0, n_p - 1:n_p + n_c - 1], ids[0, n_p:n_p + n_c])
    hand.backward()
    assert abs(out.loss.item() - hand.item()) < 1e-6
    assert torch.allclose(grad_model, model.lm_head.weight.grad, rtol=0, atol=1e-7)
    # the test can fail: labels on the prompt too give another loss
    unmasked = model(ids, labels=torch.where(pos < n_p + n_c, ids, -100), position_ids=pos).loss
    assert abs(unmasked.item() - hand.item()) > 1e-3
    # the shifted form for models that do not shift gives the same loss
    own = F.cross_entropy(logits[0], sft.next_token_labels(labels)[0], ignore_index=-100)
    assert abs(own.item() - hand.item()) < 1e-6


def test_packed_examples_do_not_attend_to_each_other(tmp_path, tok):
    seq = 96
    rows = [CHAT2, PC, {"prompt": "The cat", "completion": " sat on the mat."}]
    train, _ = sft.build_sft(_jsonl(tmp_path / "d.jsonl", rows), tok, seq)
    assert len(train) == 1  # all three share one row, followed by padding
    ids, _, pos = train.rows(slice(0, 1))
    starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [int(train.tokens)]
    assert len(starts) == 4 and train.tokens < seq
    model = _model(len(tok), seq).eval()
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits
        flat = model(ids, position_ids=torch.arange(seq)[None]).logits
        twice = model(ids.repeat(2, 1), position_ids=pos.repeat(2, 1)).logits
        for k, (a, b) in enumerate(itertools.pairwise(starts)):
            alone = model(ids[:, a:b]).logits
            assert torch.allclose(packed[:, a:b], alone, atol=1e-5, rtol=0), k
            assert torch.allclose(twice[1:, a:b], alone, atol=1e-5, rtol=0), k
            if k:  # without the resets the later examples see the earlier ones
                assert (flat[:, a:b] - alone).abs().max() > 1e-3, k
