"""Tokenizers: the fixed character vocabulary, the local HF wrapper, round trips on every
task's prompts and answers, and config errors that name the key."""
import itertools
import json

import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.tasks import get_task, task_config
from pipelinerl_jax.tokenizer import (CHAR_VOCAB, CharTokenizer, HFTokenizer, get_tokenizer,
                                       tokenizer_config)

TEXTS = ["Héllo wörld — 😀 #### 42\n", "$1,000.50 \\boxed{7}", "  leading and trailing  ", ""]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A byte-level BPE tokenizer trained here on a few lines, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 5 + ["Question: how many beads?\nAnswer:\n"] * 5, trainer)
    path = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return str(path)


def test_char_vocabulary_is_fixed_and_small():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == len(CHAR_VOCAB) == 56 < 64
    assert tok.encode("ab=") == [5, 6, 47]  # ids are part of saved checkpoints: never reorder
    assert tok.encode_prompt("ab=") == [1, 5, 6, 47]
    assert tok.encode_completion("ba") == [6, 5, 2]


def test_char_decode_drops_specials_and_stops_at_eos_only_when_asked():
    tok = CharTokenizer()
    ids = [1, *tok.encode("ab"), 2, *tok.encode("cd"), 0, 0]
    assert tok.decode(ids) == "abcd"
    assert tok.decode(ids, stop_at_eos=True) == "ab"
    with pytest.raises(ValueError, match="id 56 is outside"):
        tok.decode([5, 56])
    with pytest.raises(ValueError, match="id -1 is outside"):
        tok.decode([-1])


def test_char_unknown_character_is_named():
    with pytest.raises(ValueError, match=r"'A' \(U\+0041\) at position 2"):
        CharTokenizer().encode("abAc")


def test_hf_wrapper_on_a_locally_built_tokenizer(hf_dir):
    tok = HFTokenizer(hf_dir)
    assert tok.name == "hf:tiny-bpe" and tok.vocab_size >= 258
    assert tok.bos_id is not None and tok.pad_id == tok.eos_id  # no pad token: falls back
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids  # no specials added
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode_prompt(text) + [tok.eos_id] + tok.encode("x"),
                          stop_at_eos=True) == text


def test_hf_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        HFTokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=str(tmp_path)):
        HFTokenizer(str(tmp_path))  # a directory without tokenizer files


def test_every_task_round_trips(tmp_path, hf_dir):
    char, hf = CharTokenizer(), HFTokenizer(hf_dir)
    gsm8k = tmp_path / "g.jsonl"
    gsm8k.write_text(json.dumps({"question": "Ann has 2 pens; Bob has 3. How many in total?",
                                 "answer": "2+3 = <<2+3=5>>5 pens.\n#### 5"}) + "\n")
    for name in ["reverse", "copy", "sort", "countdown", "gsm8k"]:
        task = get_task(task_config(name, path=str(gsm8k), eval_size=0))
        # gsm8k's natural-language text is beyond the char vocabulary by design.
        tokenizers = [hf] if name == "gsm8k" else [char, hf]
        for problem, target in itertools.islice(task.demonstrations(0), 50):
            for tok in tokenizers:
                for text in (problem.prompt, target):
                    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="'Q'"):
        char.encode(next(task.problems(0)).prompt)  # 'Question: ...' names the first misfit


def test_config_builds_and_errors_name_the_key(tmp_path, hf_dir):
    assert isinstance(get_tokenizer(tokenizer_config()), CharTokenizer)
    cfg = tokenizer_config()
    cfg.kind, cfg.path = "hf", hf_dir
    assert isinstance(get_tokenizer(cfg), HFTokenizer)
    for overrides, pattern in [({"kind": "bpe"}, r"^tokenizer\.kind: must be one of"),
                               ({"kind": "hf"}, r"^tokenizer\.path: must name"),
                               ({"kind": "hf", "path": str(tmp_path / "x")},
                                r"^tokenizer\.path: directory .*x' does not exist")]:
        cfg = tokenizer_config()
        cfg.update(overrides)
        with pytest.raises(ConfigError, match=pattern):
            get_tokenizer(cfg)
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: HFTokenizer: cannot load"):
        get_tokenizer({"kind": "hf", "path": str(tmp_path)})  # exists, holds no tokenizer
    with pytest.raises(ConfigError, match=r"^engine\.tokenizer\.vocab: unknown key"):
        get_tokenizer({"kind": "char", "path": "", "vocab": 3}, prefix="engine.tokenizer")
    with pytest.raises(ConfigError, match=r"^tokenizer\.path: is missing"):
        get_tokenizer({"kind": "char"})
